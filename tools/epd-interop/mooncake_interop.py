#!/usr/bin/env python3
"""iris serve as vLLM's ECMooncakeConnector producer, checked against vLLM 0.33's own consumer.

Runs on loopback, with ports chosen free:

    client -> disagg_epd_proxy.py (vLLM's, unchanged, --ec-consumer-zmq-addrs)
                 -> tap -> iris serve (E, ECMooncakeConnector ec_producer)
                 -> stand-in decode server (D)

The stand-in decode server embeds vLLM's real `ECMooncakeConnector` as an `ec_consumer`, in
both roles (SCHEDULER and WORKER), built from a small config with a CPU receive slab. Its
worker services listen at the control address the proxy names to iris, so iris pushes each
item's rows into it over ZMQ control messages and Mooncake's P2P handshake and TCP write.
When the proxy forwards the decode request (media rewritten to `image_embeds` and
`video_embeds`, with `ec_transfer_params.ec_items`), the stand-in runs the consumer's scheduler/worker loop
(`ensure_cache_available`, `build_connector_meta`, `bind_connector_metadata`,
`start_load_caches`, `build_connector_worker_meta`, `update_connector_output`) until every
item is in its encoder cache, records the tensors, ends the request as vLLM does
(`request_finished`, then the cache entries are freed) and answers a `chat.completion`.

The checks (one PASS/FAIL line each, exit status 1 on any failure):

  response   every iris reply validates as vLLM's `ChatCompletionResponse` and names every
             image in `ec_transfer_params`, each identifier with the `transfer_id` vLLM's
             producer reports (that of the identifier's last item in the request's `ec_items`)
  pushes     every image of every request (one image; two in one request; an image repeated
             within a request and across requests; an image with a uuid; a new image twice in
             one request) reaches the consumer through the connector: `[tokens, width]` for the
             grid iris returned, bfloat16
  rows       the rows received equal `iris encode --dtype bf16` of the same image, bit for bit
  settled    afterwards no reservation of the consumer's `ConsumerReservationManager` is still
             active (reserved and neither loaded nor released), and no cancel is pending
  handshake  the consumer's Mooncake handshake daemon (its rpc port, from a reserve reply)
             answers a metadata frame with a TCP segment whose buffer holds every `dst_ptr`
  fault      a request naming a consumer where nothing listens gets a 5xx JSON answer that
             names that consumer, within the time vLLM's producer takes to give up (two shard
             discoveries, each bounded by `control_timeout_s`) plus 2.5 s

`--record FILE` writes what a replay test needs: every control exchange the consumer's REP
socket saw, in order, each request with its reply and whether the consumer's own scheduler
sent it; the handshake request and reply frame; each pushed item's identifier, transfer id,
shape, dtype and rows (hex); and the encoder requests and iris's replies.

`--self-test` runs the same topology and checks with a small Python producer in place of iris
(pyzmq REQ control messages, a raw-socket handshake and TCP write) that pushes deterministic
rows: it shows that the stand-in receives real pushes through vLLM's connector.

Needs a Python with vLLM 0.33.0 (no GPU needed), mooncake-transfer-engine (its TCP transport;
libibverbs must be loadable), pyzmq, aiohttp and Pillow; downloads nothing. See README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import io
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The consumer must advertise and listen on loopback only, and use Mooncake's TCP transport
# even where an RDMA device exists. vLLM and Mooncake are imported later, inside functions.
os.environ["VLLM_HOST_IP"] = "127.0.0.1"
os.environ["MC_FORCE_TCP"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interop import (
    Checks,
    Recorder,
    chat,
    encode_and_compare,
    find_proxy,
    free_port,
    http_json,
    image_part,
    load_clips,
    make_images,
    media_parts,
    part_bytes,
    part_kind,
    serving_app,
    stand_in_completion,
    start_site,
    video_part,
    wait_http,
    wait_listening,
)

# Qwen-VL merges 2x2 patches into one embedding row.
MERGE = 2
# How long the stand-in waits for a pushed item before answering the decode request with an error.
LOAD_TIMEOUT_S = 60
# Mooncake's handshake frame types (`HandShakeRequestType`) and TCP transport constants.
HANDSHAKE_METADATA = 1
TCP_OP_WRITE = 1
TCP_OP_STATUS_FLAG = 0x80
TCP_STATUS_OK = 0x4D435456_00000000
# How often vLLM's producer asks a consumer for its shards before failing a push, and the slack
# the fault check allows beyond those control timeouts.
DISCOVERY_ATTEMPTS = 2
FAULT_MARGIN_S = 2.5


# --------------------------------------------------------------------------------------------
# The consumer: vLLM's ECMooncakeConnector, both roles, behind a decode stand-in
# --------------------------------------------------------------------------------------------


class ConsumerStandIn:
    """vLLM's Mooncake consumer and an aiohttp decode server driving it, on their own threads.

    The connector's scheduler role is single-threaded in vLLM, so every decode request is
    driven on one worker thread, one after another.
    """

    def __init__(self, served_model: str, buffer_size: int):
        self.served_model = served_model
        self.buffer_size = buffer_size
        self.ec_port = free_port()
        self.control_addr = f"tcp://127.0.0.1:{self.ec_port}"
        self.control: list[dict] = []  # {"request", "reply", "origin"} in the order seen
        self.decode_requests: list[dict] = []  # {"request", "headers", "status", "info"}
        self.received: list[dict] = []  # one per ec_items entry loaded
        self._rep_pending: dict | None = None
        self._scheduler_sent: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._driver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="consumer-step")
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    # ---- the connector ----------------------------------------------------------------------

    def start(self) -> None:
        import torch
        from vllm.config import ECTransferConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector import (
            ECMooncakeConnector,
        )

        self._patch_rep_sockets()
        ec_config = ECTransferConfig(
            ec_connector="ECMooncakeConnector",
            ec_role="ec_consumer",
            ec_buffer_device="cpu",
            ec_buffer_size=self.buffer_size,
            ec_ip="127.0.0.1",
            ec_port=self.ec_port,
            ec_connector_extra_config={"mooncake_protocol": "tcp"},
        )
        config = types.SimpleNamespace(
            ec_transfer_config=ec_config,
            parallel_config=types.SimpleNamespace(
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=1,
                data_parallel_index=0,
            ),
            model_config=types.SimpleNamespace(dtype=torch.bfloat16),
        )
        self.scheduler = ECMooncakeConnector(config, ECConnectorRole.SCHEDULER)
        self.worker = ECMooncakeConnector(config, ECConnectorRole.WORKER)
        self._tag_scheduler_requests()
        self.worker.start_worker_services()
        # Let the scheduler subscribe to the readiness events before any push arrives.
        deadline = time.monotonic() + 30
        while self.scheduler._scheduler._event_inbox._socket is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the consumer's scheduler did not subscribe to its event channel")
            self._driver.submit(self.scheduler.has_cache_item, "").result()
            time.sleep(0.05)
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the stand-in decode server did not start")

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self._driver.submit(self.scheduler.shutdown).result()
        self.worker.shutdown()
        self._driver.shutdown()

    def _patch_rep_sockets(self) -> None:
        """Record what every REP socket of this process receives and answers, in order."""
        import zmq

        if getattr(zmq.Socket, "_interop_patched", False):
            return
        recv_json, send_json = zmq.Socket.recv_json, zmq.Socket.send_json
        standin = self

        def recording_recv(sock, *args, **kwargs):
            message = recv_json(sock, *args, **kwargs)
            if sock.socket_type == zmq.REP:
                standin._on_request(message)
            return message

        def recording_send(sock, obj, *args, **kwargs):
            if sock.socket_type == zmq.REP:
                standin._on_reply(obj)
            return send_json(sock, obj, *args, **kwargs)

        zmq.Socket.recv_json = recording_recv
        zmq.Socket.send_json = recording_send
        zmq.Socket._interop_patched = True

    def _tag_scheduler_requests(self) -> None:
        """Mark the control requests the consumer's own scheduler sends (discovery, cancels)."""
        client = self.scheduler._scheduler._control_client
        exchange = client._exchange

        def tagged(addr, payload):
            with self._lock:
                self._scheduler_sent[json.dumps(payload, sort_keys=True)] += 1
            return exchange(addr, payload)

        client._exchange = tagged

    def _on_request(self, message) -> None:
        with self._lock:
            key = json.dumps(message, sort_keys=True)
            origin = "producer"
            if self._scheduler_sent[key] > 0:
                self._scheduler_sent[key] -= 1
                origin = "consumer scheduler"
            self._rep_pending = {"origin": origin, "request": message}

    def _on_reply(self, reply) -> None:
        with self._lock:
            entry = self._rep_pending or {"origin": "unknown", "request": None}
            self._rep_pending = None
            entry["reply"] = json.loads(json.dumps(reply))
            self.control.append(entry)

    def consume(self, body: dict) -> tuple[int, dict]:
        """Drives vLLM's consumer for one forwarded decode request (on the driver thread)."""
        params = body.get("ec_transfer_params") or {}
        items = params.get("ec_items") or []
        parts = media_parts(body)
        n = len(self.decode_requests)
        request_id = f"decode-{n}"
        if not items:
            return 400, {"error": f"no ec_transfer_params.ec_items in {json.dumps(params)[:500]}"}
        if len(items) != len(parts):
            return 400, {"error": f"{len(items)} ec_items for {len(parts)} media parts"}
        features = []
        offset = 1  # a text token before the first image
        for k, (item, part) in enumerate(zip(items, parts)):
            modality = {"image_embeds": "image", "video_embeds": "video"}.get(part.get("type"))
            grid = (part.get(f"{modality}_embeds") or {}).get(f"{modality}_grid_thw")
            if modality is None or not isinstance(grid, list) or len(grid) != 3:
                return 400, {
                    "error": f"part {k} is not an image_embeds or video_embeds part with a grid: {json.dumps(part)[:300]}"
                }
            tokens = grid[0] * grid[1] * grid[2] // (MERGE * MERGE)
            features.append(
                types.SimpleNamespace(
                    identifier=str(item["mm_hash"]),
                    modality=modality,
                    mm_position=types.SimpleNamespace(offset=offset, length=tokens),
                )
            )
            offset += tokens
        request = types.SimpleNamespace(
            request_id=request_id, mm_features=features, ec_transfer_params=params
        )
        cache: dict = {}
        wanted = {f.identifier for f in features}
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        error = None
        steps = 0
        while True:
            ready = self.scheduler.ensure_cache_available(request, 0)
            self._step(cache, [])
            steps += 1
            if request_id in self.scheduler.take_unavailable_requests():
                error = "the consumer's scheduler marked the request unavailable (push failed or expired)"
                break
            if ready and wanted <= cache.keys():
                break
            if time.monotonic() > deadline:
                missing = sorted(wanted - cache.keys())
                error = f"items not loaded within {LOAD_TIMEOUT_S} s: {missing}"
                break
            time.sleep(0.01)
        got = []
        for k, (item, feature) in enumerate(zip(items, features)):
            tensor = cache.get(feature.identifier)
            entry = {
                "request": n,
                "index": k,
                "mm_hash": feature.identifier,
                "transfer_id": str(item.get("transfer_id")),
                "tokens": feature.mm_position.length,
                "tensor": None if tensor is None else tensor.clone(),
            }
            got.append(entry)
        # The request ends as in vLLM: the scheduler releases its transfers, then the encoder
        # cache entries are freed in a later step.
        self.scheduler.request_finished(request)
        self._step(cache, sorted(wanted))
        self._settle_cancels()
        with self._lock:
            self.received.extend(got)
        if error is not None:
            return 502, {"error": error, "steps": steps}
        return 200, {"steps": steps}

    def _step(self, cache: dict, freed: list[str]) -> None:
        """One engine step of the consumer, in the order vLLM's scheduler and model runner run it."""
        from vllm.v1.outputs import ECConnectorOutput

        output = types.SimpleNamespace(
            free_encoder_mm_hashes=list(freed), preempted_req_ids=set(), finished_req_ids=set()
        )
        meta = self.scheduler.build_connector_meta(output)
        # The model runner drops freed entries from its encoder cache before the connector loads.
        for identifier in freed:
            cache.pop(identifier, None)
        self.worker.bind_connector_metadata(meta)
        try:
            self.worker.start_load_caches(cache)
        finally:
            self.worker.get_finished(output.finished_req_ids)
            worker_meta = self.worker.build_connector_worker_meta()
            self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker_meta))

    def _settle_cancels(self, timeout_s: float = 30) -> None:
        """Steps until the cancels the scheduler queued have been answered."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler._scheduler._pending_cancels and time.monotonic() < deadline:
            time.sleep(0.02)
            self._step({}, [])

    def reservation_state(self) -> dict:
        """What the consumer's worker still holds: active reservations and pending cancels."""

        def read():
            manager = self.worker._worker._reservations
            with manager._memory.lock:
                active = [
                    {
                        "transfer_id": r.transfer_id,
                        "mm_hash": r.mm_hash,
                        "state": r.state.name,
                        "writer": r.writer_id,
                    }
                    for r in (manager._records[t] for t in manager._active_ids)
                ]
                return {
                    "active": active,
                    "writers": sorted(manager._writers),
                    "followers": {k: list(v) for k, v in manager._followers.items() if v},
                    "pending_cancels": sorted(self.scheduler._scheduler._pending_cancels),
                    "records": len(manager._records),
                }

        return self._driver.submit(read).result()

    # ---- the decode server -------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self) -> None:
        from aiohttp import web

        async def decode_chat(request: web.Request) -> web.Response:
            body = await request.json()
            entry = {"request": body, "headers": dict(request.headers)}
            loop = asyncio.get_running_loop()
            try:
                status, info = await loop.run_in_executor(self._driver, self.consume, body)
            except Exception as err:  # reported with the request, never swallowed
                status, info = 500, {"error": f"stand-in consumer raised {err!r}"}
            entry.update(status=status, info=info)
            self.decode_requests.append(entry)
            if status != 200:
                return web.json_response({"error": {"message": info["error"]}}, status=status)
            return web.json_response(
                stand_in_completion(len(self.decode_requests), body.get("model", self.served_model))
            )

        self.port = await start_site(serving_app(decode_chat, self.served_model))


# --------------------------------------------------------------------------------------------
# Mooncake's wires, as a producer speaks them (handshake probe and the self-test producer)
# --------------------------------------------------------------------------------------------


def handshake(session: str, local: dict, timeout_s: float = 10) -> tuple[bytes, dict]:
    """One metadata exchange with a handshake daemon: (reply frame, the segment it describes)."""
    host, port = session.rsplit(":", 1)
    body = json.dumps(local).encode()
    with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
        conn.sendall(struct.pack("<Q", len(body) + 1) + bytes([HANDSHAKE_METADATA]) + body)
        frame = b""
        while True:  # the daemon shuts its side down after replying
            chunk = conn.recv(65536)
            if not chunk:
                break
            frame += chunk
    if len(frame) < 9:
        raise RuntimeError(f"handshake with {session}: short reply {frame.hex()}")
    (length,) = struct.unpack("<Q", frame[:8])
    if frame[8] != HANDSHAKE_METADATA or length != len(frame) - 8:
        raise RuntimeError(
            f"handshake with {session}: frame type {frame[8]}, length {length}, {len(frame)} bytes"
        )
    return frame, json.loads(frame[9:])


def tcp_write(segment: dict, dst_ptr: int, payload: bytes, timeout_s: float = 10) -> None:
    """One write with Mooncake's TCP transport into a segment the handshake described."""
    version = int(segment.get("tcp_proto_version", 1))
    opcode = TCP_OP_WRITE | (TCP_OP_STATUS_FLAG if version >= 2 else 0)
    addr = (segment.get("tcp_data_host") or "127.0.0.1", int(segment["tcp_data_port"]))
    with socket.create_connection(addr, timeout=timeout_s) as conn:
        conn.sendall(struct.pack("<QQB7x", len(payload), dst_ptr, opcode) + payload)
        if version >= 2:
            status = b""
            while len(status) < 8:
                chunk = conn.recv(8 - len(status))
                if not chunk:
                    raise RuntimeError("TCP write: the consumer closed before its status")
                status += chunk
            (code,) = struct.unpack("<Q", status)
            if code != TCP_STATUS_OK:
                raise RuntimeError(f"TCP write to {dst_ptr:#x}: status {code:#x}")


class SelfTestProducer:
    """A small producer of deterministic rows, speaking the control wire and Mooncake's.

    It stands where iris stands in the self-test: it answers the encoder requests the proxy
    sends, pushes one `[tokens, 64]` bfloat16 tensor per image into the named consumer and
    replies with `ec_transfer_params` as vLLM's producer does.
    """

    WIDTH = 64

    def __init__(self, served_model: str, timeout_s: float):
        import zmq

        self.served_model = served_model
        self.timeout_ms = int(timeout_s * 1000)
        self.context = zmq.Context()
        self.tensors: dict[str, object] = {}  # identifier -> the rows pushed
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="self-test-producer")
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the self-test producer did not start")

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.pool.shutdown()
        self.context.destroy(linger=0)

    @staticmethod
    def grid(data: bytes) -> list[int]:
        from PIL import Image

        width, height = Image.open(io.BytesIO(data)).size
        patch = 14 * MERGE
        return [1, MERGE * max(1, round(height / patch)), MERGE * max(1, round(width / patch))]

    def rows(self, data: bytes, grid: list[int]):
        import torch

        tokens = grid[0] * grid[1] * grid[2] // (MERGE * MERGE)
        seed = int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(tokens, self.WIDTH, generator=gen).to(torch.bfloat16)

    def request(self, sock, message: dict) -> dict:
        sock.send_json(message)
        reply = sock.recv_json()
        if not reply.get("ok"):
            raise RuntimeError(f"{message.get('op')}: {reply.get('error')}")
        return reply["result"]

    def push(self, consumer: str, specs: list[dict], tensors: list) -> None:
        import zmq

        def connect(addr: str):
            sock = self.context.socket(zmq.REQ)
            for opt, value in (
                (zmq.RCVTIMEO, self.timeout_ms),
                (zmq.SNDTIMEO, self.timeout_ms),
                (zmq.LINGER, 0),
            ):
                sock.setsockopt(opt, value)
            sock.connect(addr)
            return sock

        base = connect(consumer)
        try:
            ports = self.request(base, {"op": "peers"})["ports"]
        finally:
            base.close()
        host = consumer.rsplit(":", 1)[0]
        for port in ports:
            sock = connect(f"{host}:{port}")
            try:
                result = self.request(sock, {"op": "reserve_batch", "items": specs})
                reservations = []
                for spec, item in zip(specs, result["items"]):
                    if not item.get("ok"):
                        raise RuntimeError(f"reserve {spec['transfer_id']}: {item.get('error')}")
                    reservations.append(item["result"])
                segments: dict[str, dict] = {}
                written = []
                try:
                    for spec, tensor, res in zip(specs, tensors, reservations):
                        if res.get("cancelled") or res.get("cached") or not res.get("write"):
                            continue
                        session = res["dst_session"]
                        if session not in segments:
                            segments[session] = handshake(session, {"name": "self-test-producer"})[1]
                        payload = tensor_bytes(tensor)
                        if len(payload) != int(res["nbytes"]):
                            raise RuntimeError(f"reserved {res['nbytes']} bytes for {len(payload)}")
                        tcp_write(segments[session], int(res["dst_ptr"]), payload)
                        written.append(
                            {"transfer_id": spec["transfer_id"], "reservation_id": res["reservation_id"]}
                        )
                    if written:
                        done = self.request(sock, {"op": "complete_batch", "items": written})
                        if not all(item.get("completed") for item in done["items"]):
                            raise RuntimeError(f"complete_batch: {done}")
                except Exception:
                    for spec, res in zip(specs, reservations):
                        if not res.get("cancelled"):
                            self.request(
                                sock,
                                {
                                    "op": "cancel",
                                    "transfer_id": spec["transfer_id"],
                                    "reservation_id": res.get("reservation_id", ""),
                                    "abandon": True,
                                },
                            )
                    raise
            finally:
                sock.close()

    def encode(self, body: dict) -> tuple[int, dict]:
        parts = media_parts(body)
        params = body.get("ec_transfer_params") or {}
        items = params.get("ec_items") or []
        if len(items) != len(parts):
            return 400, {"error": {"message": f"{len(items)} ec_items for {len(parts)} items"}}
        reported: dict[str, dict] = {}
        specs, tensors = [], []
        for k, (part, item) in enumerate(zip(parts, items)):
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            identifier = part.get("uuid") or hashlib.sha256(data).hexdigest()
            grid = self.grid(data)
            tensor = self.rows(data, grid)
            self.tensors[identifier] = tensor
            entry = reported.setdefault(
                identifier,
                {"modality": "image", "item_indices": [], "metadata": {"image_grid_thw": grid}},
            )
            entry["item_indices"].append(k)
            entry["transfer_id"] = item["transfer_id"]
            specs.append(
                {
                    "transfer_id": item["transfer_id"],
                    "mm_hash": identifier,
                    "nbytes": tensor.numel() * tensor.element_size(),
                    "shape": list(tensor.shape),
                    "dtype": "bfloat16",
                }
            )
            tensors.append(tensor)
        try:
            self.push(params["consumer_zmq"], specs, tensors)
        except Exception as err:
            return 503, {"error": {"message": f"push to {params.get('consumer_zmq')} failed: {err}"}}
        return 200, {
            "id": f"chatcmpl-selftest-{time.time_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", self.served_model),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1},
            "ec_transfer_params": reported,
        }

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self) -> None:
        from aiohttp import web

        async def encode(request: web.Request) -> web.Response:
            body = await request.json()
            status, reply = await asyncio.get_running_loop().run_in_executor(self.pool, self.encode, body)
            return web.json_response(reply, status=status)

        self.port = await start_site(serving_app(encode, self.served_model))


def tensor_bytes(tensor) -> bytes:
    """A tensor's bytes, row-major, as they travel and as the consumer's slab holds them."""
    import torch

    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iris", help="the iris binary (e.g. target/debug/iris); not with --self-test")
    parser.add_argument("--self-test", action="store_true", help="a Python producer in place of iris")
    parser.add_argument("--proxy", help="vLLM 0.33.0's disagg_epd_proxy.py")
    parser.add_argument("--vllm-src", help="folder holding an unpacked vLLM 0.33.0 source distribution")
    parser.add_argument("--model", default="tiny", help="iris --model (default tiny)")
    parser.add_argument("--dtype", default="bf16", help="iris --dtype (default bf16)")
    parser.add_argument(
        "--control-timeout", type=float, default=5, help="iris's control_timeout_s (default 5)"
    )
    parser.add_argument(
        "--ec-buffer-size", type=int, default=64 << 20, help="the consumer's receive slab in bytes"
    )
    parser.add_argument("--record", help="write the recorded exchanges to this JSON file")
    parser.add_argument("--work-dir", help="keep the logs, images and recorded exchanges here")
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()
    if args.self_test == bool(args.iris):
        parser.error("give either --iris BINARY or --self-test")

    iris = None
    if args.iris:
        iris = Path(args.iris).resolve()
        if not iris.is_file():
            sys.exit(f"--iris {iris}: no such file")
    proxy_path = find_proxy(args)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="iris-mooncake-interop-")).resolve()
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work-dir {work} is not empty; give a fresh folder")
    work.mkdir(parents=True, exist_ok=True)
    served = "interop-model"
    print(f"work folder {work}; proxy {proxy_path}")

    import vllm

    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}")
    procs: list[subprocess.Popen] = []
    standin = recorder = producer = None
    checks = Checks()
    record: dict = {}
    try:
        standin = ConsumerStandIn(served, args.ec_buffer_size)
        standin.start()
        decode_url = f"http://127.0.0.1:{standin.port}"
        print(f"consumer control {standin.control_addr}; stand-in decode server {decode_url}")

        iris_cmd = None
        if iris is not None:
            ec_config = {
                "ec_connector": "ECMooncakeConnector",
                "ec_role": "ec_producer",
                "ec_connector_extra_config": {
                    "mooncake_protocol": "tcp",
                    "control_timeout_s": args.control_timeout,
                },
            }
            iris_log = open(work / "iris.log", "w")
            iris_cmd = [
                str(iris), "serve", "--model", args.model, "--dtype", args.dtype,
                "--host", "127.0.0.1", "--port", "0",
                "--ec-transfer-config", json.dumps(ec_config),
                "--served-model-name", served,
            ]  # fmt: skip
            print("$ " + " ".join(iris_cmd))
            iris_proc = subprocess.Popen(iris_cmd, stdout=subprocess.PIPE, stderr=iris_log, text=True)
            procs.append(iris_proc)
            encoder_url = wait_listening(iris_proc, args.startup_timeout, work / "iris.log")
        else:
            producer = SelfTestProducer(served, args.control_timeout)
            producer.start()
            encoder_url = f"http://127.0.0.1:{producer.port}"
            print(f"self-test producer {encoder_url}")

        # The tap in front of the encoder; its own decode server is not used.
        recorder = Recorder(encoder_url, served)
        recorder.start()
        tap_url = f"http://127.0.0.1:{recorder.ports['tap']}"

        proxy_port = free_port()
        proxy_cmd = [
            sys.executable, str(proxy_path), "--host", "127.0.0.1", "--port", str(proxy_port),
            "--encode-servers-urls", tap_url, "--prefill-servers-urls", "disable",
            "--decode-servers-urls", decode_url, "--ec-consumer-zmq-addrs", standin.control_addr,
        ]  # fmt: skip
        print("$ " + " ".join(proxy_cmd))
        proxy_log = open(work / "proxy.log", "w")
        proxy_proc = subprocess.Popen(proxy_cmd, stdout=proxy_log, stderr=subprocess.STDOUT)
        procs.append(proxy_proc)
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        wait_http(f"{proxy_url}/health", proxy_proc, "the proxy", 120)

        run_checks(
            args, iris, encoder_url, proxy_url, recorder, standin, producer, work, served, checks, record
        )
        record.update(
            {
                "vllm": vllm.__version__,
                "mooncake": package_version("mooncake-transfer-engine-non-cuda")
                or package_version("mooncake-transfer-engine"),
                "producer": "iris" if iris is not None else "self-test",
                "iris_command": iris_cmd,
                "consumer_control": standin.control_addr,
                "control": standin.control,
                "encoder_exchanges": recorder.encoder_exchanges,
                "decode_requests": [
                    {"request": e["request"], "status": e["status"], "info": e["info"]}
                    for e in standin.decode_requests
                ],
            }
        )
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for part in (recorder, producer, standin):
            if part is not None:
                part.stop()
    text = json.dumps(record, indent=1)
    (work / "exchanges.json").write_text(text)
    if args.record:
        Path(args.record).write_text(text)
        print(f"recorded {len(record.get('control', []))} control exchanges, "
              f"{len(record.get('items', []))} pushed items: {args.record}")  # fmt: skip
    print(f"exchanges: {work / 'exchanges.json'}; logs: {work}/*.log")
    ok = checks.report()
    print("mooncake interop: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run_checks(args, iris, encoder_url, proxy_url, recorder, standin, producer, work, served, checks, record):
    import torch
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    images = make_images()
    used = ("rgb.png", "grey.png", "palette.png", "photo.jpg")
    (work / "images").mkdir()
    for name in used:
        (work / "images" / name).write_bytes(images[name])
    clips = load_clips()
    (work / "videos").mkdir()
    for name, data in clips.items():
        (work / "videos" / name).write_bytes(data)

    # ---- requests through the proxy -----------------------------------------------------
    proxied = [
        ("one image", chat([image_part("rgb.png", images["rgb.png"])], served)),
        ("two images", chat([image_part(n, images[n]) for n in ("grey.png", "palette.png")], served)),
        (
            "an image twice in the request, and from the first request",
            chat(
                [image_part("rgb.png", images["rgb.png"]), image_part("rgb.png", images["rgb.png"])], served
            ),
        ),
        (
            "an image with a uuid",
            chat([image_part("palette.png", images["palette.png"], "mooncake-palette")], served),
        ),
        # Reserved together, the second item follows the first one's write (`write: false`).
        (
            "a new image twice in the request",
            chat(
                [image_part("photo.jpg", images["photo.jpg"]), image_part("photo.jpg", images["photo.jpg"])],
                served,
            ),
        ),
    ]
    if iris is not None:
        # The proxy sends the video in its own encoder request; the self-test producer has no
        # video processor, so only iris gets one.
        proxied.append(
            (
                "a video and an image",
                chat([video_part("odd9.mp4", clips["odd9.mp4"]), image_part("grey.png", images["grey.png"])], served),
            )
        )
    for n, (name, body) in enumerate(proxied):
        before = len(recorder.encoder_exchanges)
        status, reply = http_json(
            "POST", f"{proxy_url}/v1/chat/completions", body, {"x-request-id": f"mooncake-{n}"}
        )
        if status != 200:
            checks.fail("response", f"proxy request {name!r}: HTTP {status}: {str(reply)[:2000]}")
        if len(recorder.encoder_exchanges) == before:
            checks.fail("response", f"proxy request {name!r}: no encoder request reached the producer")

    # ---- the replies --------------------------------------------------------------------
    by_bytes = {data: name for name, data in (images | clips).items()}
    published: dict[str, dict] = {}  # identifier -> kind, file name, grid
    for ex in recorder.encoder_exchanges:
        request, reply = ex["request"], ex["reply"]
        label = f"encoder request {request.get('ec_transfer_params', {}).get('ec_items')}"
        if ex["status"] != 200:
            checks.fail("response", f"{label}: HTTP {ex['status']}: {str(reply)[:2000]}")
            continue
        try:
            ChatCompletionResponse.model_validate(reply)
        except Exception as err:  # pydantic's ValidationError, named in the message
            checks.fail("response", f"{label}: not a valid ChatCompletionResponse: {err}")
        params = reply.get("ec_transfer_params") if isinstance(reply, dict) else None
        if not isinstance(params, dict):
            checks.fail("response", f"{label}: no ec_transfer_params in {json.dumps(reply)[:1000]}")
            continue
        items = (request.get("ec_transfer_params") or {}).get("ec_items") or []
        parts = media_parts(request)
        seen = {}
        for ident, entry in params.items():
            for k in entry.get("item_indices", []):
                seen[k] = ident
        for k, part in enumerate(parts):
            ident = seen.get(k)
            if ident is None:
                checks.fail("response", f"{label}: item {k} missing from ec_transfer_params {params}")
                continue
            kind = part_kind(part)
            if params[ident].get("modality") != kind:
                checks.fail("response", f"{label}: {ident}: modality {params[ident].get('modality')!r}, sent a {kind}")
            published[ident] = {
                "kind": kind,
                "name": by_bytes.get(part_bytes(part)),
                "grid": (params[ident].get("metadata") or {}).get(f"{kind}_grid_thw"),
                "mm_processor_kwargs": request.get("mm_processor_kwargs") or {},
                "media_io_kwargs": request.get("media_io_kwargs") or {},
            }
        # vLLM's producer reports, per identifier, the transfer id of its last item.
        for ident, entry in params.items():
            indices = [k for k, i in seen.items() if i == ident]
            if not indices or max(indices) >= len(items):
                continue
            want = items[max(indices)].get("transfer_id")
            if entry.get("transfer_id") != want:
                checks.fail(
                    "response",
                    f"{label}: {ident}: transfer_id {entry.get('transfer_id')!r}, vLLM's producer reports {want!r}",
                )
    checks.close(
        "response",
        f"{len(recorder.encoder_exchanges)} encoder replies valid ChatCompletionResponse with ec_transfer_params "
        "and transfer ids",
    )

    # ---- what the consumer received through the connector ----------------------------------
    if len(standin.decode_requests) != len(proxied):
        checks.fail("pushes", f"{len(proxied)} requests sent, {len(standin.decode_requests)} reached decode")
    for entry in standin.decode_requests:
        if entry["status"] != 200:
            checks.fail(
                "pushes",
                f"decode request {entry['info']}: {json.dumps(entry['request'].get('ec_transfer_params'))[:500]}",
            )
        # Without hash factors a consumer's identifier of a forwarded part is its uuid: the
        # identifier the push was made under must be that one, or vLLM would never find it.
        forwarded = entry["request"]
        if not forwarded.get("mm_processor_kwargs") and not forwarded.get("media_io_kwargs"):
            items = (forwarded.get("ec_transfer_params") or {}).get("ec_items") or []
            for k, (part, item) in enumerate(zip(media_parts(forwarded), items)):
                if part.get("uuid") != item.get("mm_hash"):
                    checks.fail(
                        "pushes",
                        f"forwarded part {k}: the consumer's identifier (uuid) {part.get('uuid')!r}, "
                        f"pushed as {item.get('mm_hash')!r}",
                    )
    loaded: dict[str, object] = {}
    widths = set()
    for got in standin.received:
        ident, tensor = got["mm_hash"], got["tensor"]
        where = f"request {got['request']} item {got['index']} ({ident}, transfer {got['transfer_id']})"
        if tensor is None:
            checks.fail("pushes", f"{where}: not in the consumer's encoder cache")
            continue
        info = published.get(ident)
        if info is None:
            checks.fail("pushes", f"{where}: an identifier no encoder reply named")
            continue
        t, h, w = info["grid"]
        if (
            tensor.dtype != torch.bfloat16
            or tensor.dim() != 2
            or tensor.shape[0] != t * h * w // (MERGE * MERGE)
        ):
            checks.fail(
                "pushes",
                f"{where}: {tuple(tensor.shape)} {tensor.dtype}, grid {info['grid']} wants [{t * h * w // 4}, width] bf16",
            )
            continue
        if ident in loaded and not torch.equal(loaded[ident].view(torch.int16), tensor.view(torch.int16)):
            checks.fail("pushes", f"{where}: differs from an earlier push of the same identifier")
        loaded.setdefault(ident, tensor)
        widths.add(tensor.shape[1])
    for ident in published:
        if ident not in loaded:
            checks.fail("pushes", f"{ident} ({published[ident]['name']}): never loaded by the consumer")
    reserves = [
        c for c in standin.control
        if (c["request"] or {}).get("op") in ("reserve", "reserve_batch")
    ]  # fmt: skip
    checks.close(
        "pushes",
        f"{len(standin.received)} items of {len(standin.decode_requests)} requests loaded through "
        f"start_load_caches under the consumer's identifiers, [tokens, {sorted(widths)}] bf16 "
        f"({len(reserves)} reserve exchanges)",
    )

    # ---- rows ---------------------------------------------------------------------------
    if iris is not None:
        compared = encode_and_compare(iris, args, published, loaded, work, checks, check="rows")
        checks.close("rows", f"{compared} identifiers equal iris encode --dtype {args.dtype} bit for bit")
    else:
        for ident, tensor in loaded.items():
            want = producer.tensors.get(ident)
            if want is None or not torch.equal(want.view(torch.int16), tensor.view(torch.int16)):
                checks.fail("rows", f"{ident}: the consumer's rows differ from the rows pushed")
        checks.close("rows", f"{len(loaded)} identifiers equal the self-test producer's rows bit for bit")

    # ---- settled --------------------------------------------------------------------------
    state = standin.reservation_state()
    if state["active"] or state["pending_cancels"] or state["writers"] or state["followers"]:
        checks.fail("settled", f"the consumer still holds {json.dumps(state)[:2000]}")
    checks.close(
        "settled", f"no active reservation, writer or pending cancel left ({state['records']} tombstones)"
    )

    # ---- handshake ------------------------------------------------------------------------
    reserved = []
    for c in reserves:
        reply = (c.get("reply") or {}).get("result") or {}
        for item in reply.get("items", [{"ok": True, "result": reply}]):
            result = item.get("result") or {}
            if result.get("dst_session"):
                reserved.append(result)
    hs = {}
    if not reserved:
        checks.fail("handshake", "no reserve reply named a dst_session")
    else:
        session = reserved[0]["dst_session"]
        local = {"name": "mooncake-interop-probe"}
        try:
            frame, segment = handshake(session, local)
            hs = {"session": session, "request": local, "request_type": HANDSHAKE_METADATA,
                  "reply_frame_hex": frame.hex(), "reply": segment}  # fmt: skip
            if segment.get("protocol") != "tcp":
                checks.fail("handshake", f"protocol {segment.get('protocol')!r}, want tcp")
            buffers = [(int(b["addr"]), int(b["length"])) for b in segment.get("buffers", [])]
            for r in reserved:
                ptr, nbytes = int(r["dst_ptr"]), int(r["nbytes"])
                if not any(a <= ptr and ptr + nbytes <= a + n for a, n in buffers):
                    checks.fail(
                        "handshake", f"dst_ptr {ptr:#x}+{nbytes} is in no advertised buffer {buffers}"
                    )
        except Exception as err:
            checks.fail("handshake", f"{session}: {err!r}")
        checks.close(
            "handshake", f"{session} answers a TCP segment holding all {len(reserved)} reserved ranges"
        )
    record["handshake"] = hs

    # ---- fault: a consumer where nothing listens ------------------------------------------
    if iris is not None:
        dead = f"tcp://127.0.0.1:{free_port()}"
        body = chat([image_part("grey.png", images["grey.png"], "mooncake-fault")], served)
        body["ec_transfer_params"] = {"consumer_zmq": dead, "ec_items": [{"transfer_id": "mooncake-fault-0"}]}
        started = time.monotonic()
        status, reply = http_json("POST", f"{encoder_url}/v1/chat/completions", body)
        elapsed = time.monotonic() - started
        # vLLM's producer asks an unknown consumer for its shards twice (`_CANCEL_ATTEMPTS`)
        # before it gives up, each ask bounded by control_timeout_s.
        limit = DISCOVERY_ATTEMPTS * args.control_timeout + FAULT_MARGIN_S
        record["fault"] = {
            "request_consumer": dead,
            "status": status,
            "reply": reply,
            "elapsed_s": round(elapsed, 2),
        }
        if not (500 <= status < 600 and isinstance(reply, dict)):
            checks.fail("fault", f"HTTP {status} {str(reply)[:1000]}")
        elif dead.removeprefix("tcp://") not in json.dumps(reply):
            checks.fail("fault", f"HTTP {status} does not name {dead}: {json.dumps(reply)[:1000]}")
        if elapsed > limit:
            checks.fail(
                "fault",
                f"answered after {elapsed:.1f} s; control_timeout_s {args.control_timeout} allows {limit:.1f} s",
            )
        checks.close("fault", f"{dead}: HTTP {status} naming the consumer after {elapsed:.1f} s")
    else:
        print("fault: not run in --self-test (it checks iris's answer to an unreachable consumer)")

    # ---- the recording --------------------------------------------------------------------
    items = {}
    for got in standin.received:
        if got["tensor"] is None or got["transfer_id"] in items:
            continue
        items[got["transfer_id"]] = {
            "mm_hash": got["mm_hash"],
            "transfer_id": got["transfer_id"],
            "image": published.get(got["mm_hash"], {}).get("name"),
            "shape": list(got["tensor"].shape),
            "dtype": str(got["tensor"].dtype).removeprefix("torch."),
            "rows_hex": tensor_bytes(got["tensor"]).hex(),
        }
    record["items"] = list(items.values())


if __name__ == "__main__":
    sys.exit(main())
