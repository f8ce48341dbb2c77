#!/usr/bin/env python3
"""iris serve as vLLM's encoder instance, checked against vLLM 0.33's own code.

Runs on loopback, with ports chosen free:

    client -> disagg_epd_proxy.py (vLLM's, unchanged) -> tap -> iris serve (E)
                                                      -> stand-in decode server (D)

The tap forwards every encoder request byte for byte to iris and records request and reply,
so a failure can be reported with both. The stand-in decode server records what the proxy
forwards and answers a valid `chat.completion`. The checks (one PASS/FAIL line each, exit
status 1 on any failure):

  response   every iris reply validates as vLLM's `ChatCompletionResponse` and carries
             `ec_transfer_params` for every image and video of the request
  (a) rewrite each forwarded media part is an `image_embeds` (`video_embeds`) part whose
             `image_grid_thw` (`video_grid_thw`) is the grid iris returned for it, and whose uuid
             names a file iris wrote (the uuid itself, or vLLM's hash of it when the request has
             hash factors, as the consumer computes it)
  (b) connector every written file loads through vLLM's `ECExampleConnector` (worker role,
             `start_load_caches`), `[t*h*w/4, width]`, bf16; nothing else is in the store
  (c) rows   each file's rows equal `iris encode --dtype bf16` of the same image or clip, bit
             for bit
  (d) hashes identifiers of hashed items (no uuid, or uuid with processor kwargs) equal vLLM's
             `MultiModalHasher` over what `ImageMediaIO` makes of the same bytes, and for
             videos `ProcessorInputs.get_mm_hashes` over what `VideoMediaIO` (the model's
             loader) makes of them
  refusals   bad requests get 4xx JSON and leave no file behind

Needs a Python with vLLM 0.33.0 (no GPU needed), aiohttp and Pillow; downloads nothing.
See README.md next to this file.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import glob
import io
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

# vLLM picks its platform when first imported; without a GPU it must be told it runs on CPU, or
# building a `VllmConfig` (which the connector needs) fails to infer the device.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

PROXY_RELATIVE = "examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py"
# The committed test clips: H.264 MP4 with an even and an odd frame count, VP9 WebM.
CLIPS = Path(__file__).resolve().parents[2] / "core/tests/fixtures/video"
CLIP_NAMES = ("even10.mp4", "odd9.mp4", "vp9_12.webm")
# vLLM's loader for the tiny model's family (Qwen2.5-VL); `--video-loader` for other models.
DEFAULT_VIDEO_LOADER = "qwen2_vl"
REQUEST_TIMEOUT_S = 300


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


def make_images() -> dict[str, bytes]:
    """Small deterministic images in the modes that take different decoding and hashing paths."""
    from PIL import Image

    def gradient(width: int, height: int, seed: int) -> Image.Image:
        img = Image.new("RGB", (width, height))
        img.putdata(
            [
                ((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256)
                for y in range(height)
                for x in range(width)
            ]
        )
        return img

    def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kwargs)
        return buf.getvalue()

    rgba = gradient(84, 56, 2).convert("RGBA")
    # A semi-transparent band and a fully transparent corner: the background colour matters.
    alpha = Image.new("L", rgba.size, 255)
    alpha.paste(96, (0, 20, 84, 40))
    alpha.paste(0, (0, 0, 20, 20))
    rgba.putalpha(alpha)
    palette = gradient(70, 70, 4).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return {
        "rgb.png": encode(gradient(112, 84, 1), "PNG"),
        "rgba.png": encode(rgba, "PNG"),
        "grey.png": encode(gradient(60, 90, 3).convert("L"), "PNG"),
        "palette.png": encode(palette, "PNG"),
        "photo.jpg": encode(gradient(128, 96, 5), "JPEG", quality=90),
        # Large enough that a small `max_pixels` changes its grid.
        "large.png": encode(gradient(224, 168, 6), "PNG"),
    }


def data_url(name: str, data: bytes) -> str:
    mime = "image/jpeg" if name.endswith(".jpg") else "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(name: str, data: bytes, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": data_url(name, data)}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def load_clips() -> dict[str, bytes]:
    """The committed clips, by file name."""
    return {name: (CLIPS / name).read_bytes() for name in CLIP_NAMES}


def video_part(name: str, data: bytes, uuid: str | None = None) -> dict:
    mime = "video/webm" if name.endswith(".webm") else "video/mp4"
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    part = {"type": "video_url", "video_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def part_kind(part: dict) -> str:
    """`image` or `video`: the modality of a media part as sent."""
    return "video" if part.get("type") == "video_url" else "image"


def part_bytes(part: dict) -> bytes:
    url = part[f"{part_kind(part)}_url"]["url"]
    return base64.b64decode(url.split(",", 1)[1])


def chat(parts: list[dict], model: str, **extra) -> dict:
    content = [{"type": "text", "text": "Describe the media."}, *parts]
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


# --------------------------------------------------------------------------------------------
# Processes and small servers
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_json(method: str, url: str, body: dict | None = None, headers: dict | None = None):
    """(status, parsed JSON or text) of one HTTP exchange."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:.0f} s")


class Recorder:
    """The tap in front of iris and the stand-in decode server, on one event loop thread."""

    def __init__(self, iris_url: str, served_model: str):
        self.iris_url = iris_url
        self.served_model = served_model
        self.encoder_exchanges: list[dict] = []  # {"headers", "request", "status", "reply"}
        self.decode_requests: list[dict] = []  # {"headers", "request"}
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.ports: dict[str, int] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the tap and stand-in decode server did not start")

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, web

        session = ClientSession(timeout=ClientTimeout(total=REQUEST_TIMEOUT_S))

        async def tap(request: web.Request) -> web.Response:
            body = await request.read()
            headers = {
                k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-request-id")
            }
            async with session.request(
                request.method, self.iris_url + request.path_qs, data=body or None, headers=headers
            ) as resp:
                reply = await resp.read()
                status, ctype = resp.status, resp.headers.get("Content-Type", "application/json")
            if request.path == "/v1/chat/completions":
                self.encoder_exchanges.append(
                    {
                        "headers": headers,
                        "request": json.loads(body),
                        "status": status,
                        "reply": _maybe_json(reply),
                    }
                )
            return web.Response(body=reply, status=status, headers={"Content-Type": ctype})

        async def decode_chat(request: web.Request) -> web.Response:
            body = await request.json()
            self.decode_requests.append({"headers": dict(request.headers), "request": body})
            return web.json_response(
                stand_in_completion(len(self.decode_requests), body.get("model", self.served_model))
            )

        tap_app = web.Application(client_max_size=256 << 20)
        tap_app.router.add_route("*", "/{tail:.*}", tap)
        decode_app = serving_app(decode_chat, self.served_model)
        for name, app in (("tap", tap_app), ("decode", decode_app)):
            self.ports[name] = await start_site(app)


def stand_in_completion(number: int, model: str) -> dict:
    """The `chat.completion` a stand-in decode server answers with."""
    return {
        "id": f"chatcmpl-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "stand-in decode"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }


def serving_app(chat_handler, served_model: str):
    """An aiohttp app serving `POST /v1/chat/completions` with `chat_handler`, and the `/health`
    and `/v1/models` routes the proxy probes."""
    from aiohttp import web

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": served_model, "object": "model"}]})

    app = web.Application(client_max_size=256 << 20)
    app.router.add_post("/v1/chat/completions", chat_handler)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


async def start_site(app) -> int:
    """Serves `app` on a free loopback port and returns the port."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return site._server.sockets[0].getsockname()[1]


def _maybe_json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def find_proxy(args) -> Path:
    if args.proxy:
        path = Path(args.proxy)
        if not path.is_file():
            sys.exit(f"--proxy {path}: no such file")
        return path
    roots = [r for r in (args.vllm_src, os.environ.get("VLLM_SRC")) if r]
    if not roots:
        sys.exit(
            "give the proxy with --proxy PATH, or an unpacked vLLM 0.33.0 source distribution "
            "with --vllm-src DIR (or VLLM_SRC)"
        )
    for root in roots:
        for candidate in [Path(root) / PROXY_RELATIVE, *map(Path, glob.glob(f"{root}/*/{PROXY_RELATIVE}"))]:
            if candidate.is_file():
                return candidate
    sys.exit(f"no {PROXY_RELATIVE} under {', '.join(roots)}")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class Checks:
    def __init__(self):
        self.results: list[tuple[str, bool, str]] = []
        self.failures: dict[str, list[str]] = {}

    def fail(self, check: str, message: str) -> None:
        self.failures.setdefault(check, []).append(message)

    def close(self, check: str, summary: str) -> None:
        problems = self.failures.get(check, [])
        self.results.append((check, not problems, summary if not problems else problems[0]))

    def report(self) -> bool:
        for check, problems in self.failures.items():
            for problem in problems:
                print(f"  {check}: {problem}")
        for check, ok, text in self.results:
            more = len(self.failures.get(check, [])) - 1
            extra = f" (and {more} more failure(s), listed above)" if more > 0 else ""
            print(f"{'PASS' if ok else 'FAIL'} {check}: {text}{extra}")
        return all(ok for _, ok, _ in self.results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iris", required=True, help="the iris binary (e.g. target/debug/iris)")
    parser.add_argument("--proxy", help="vLLM 0.33.0's disagg_epd_proxy.py")
    parser.add_argument("--vllm-src", help="folder holding an unpacked vLLM 0.33.0 source distribution")
    parser.add_argument("--model", default="tiny", help="iris --model (default tiny)")
    parser.add_argument("--dtype", default="bf16", help="iris --dtype (default bf16)")
    parser.add_argument(
        "--model-id",
        default="Qwen/Qwen2.5-VL-3B-Instruct",
        help="the consumers' --model string, hashed into identifiers",
    )
    parser.add_argument("--hasher", default="blake3", choices=["blake3", "sha256", "sha512"])
    parser.add_argument(
        "--video-loader",
        default=DEFAULT_VIDEO_LOADER,
        choices=["qwen2_vl", "qwen3_vl"],
        help="vLLM's video loader for --model's family (qwen2_vl for tiny and Qwen2/2.5-VL)",
    )
    parser.add_argument("--work-dir", help="keep the store, logs and recorded exchanges here")
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()

    iris = Path(args.iris).resolve()
    if not iris.is_file():
        sys.exit(f"--iris {iris}: no such file")
    proxy_path = find_proxy(args)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="iris-epd-interop-")).resolve()
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work-dir {work} is not empty; give a fresh folder")
    store = work / "store"
    store.mkdir(parents=True)
    served = "interop-model"
    print(f"work folder {work}; proxy {proxy_path}")

    import vllm

    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}")
    procs: list[subprocess.Popen] = []
    recorder = None
    try:
        ec_config = {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": str(store)},
        }
        iris_log = open(work / "iris.log", "w")
        iris_cmd = [
            str(iris), "serve", "--model", args.model, "--dtype", args.dtype,
            "--host", "127.0.0.1", "--port", "0",
            "--ec-transfer-config", json.dumps(ec_config),
            "--mm-hasher-algorithm", args.hasher, "--model-id", args.model_id,
            "--served-model-name", served,
        ]  # fmt: skip
        print("$ " + " ".join(iris_cmd))
        iris_proc = subprocess.Popen(iris_cmd, stdout=subprocess.PIPE, stderr=iris_log, text=True)
        procs.append(iris_proc)
        iris_url = wait_listening(iris_proc, args.startup_timeout, work / "iris.log")

        recorder = Recorder(iris_url, served)
        recorder.start()
        tap_url = f"http://127.0.0.1:{recorder.ports['tap']}"
        decode_url = f"http://127.0.0.1:{recorder.ports['decode']}"

        proxy_port = free_port()
        proxy_cmd = [
            sys.executable, str(proxy_path), "--host", "127.0.0.1", "--port", str(proxy_port),
            "--encode-servers-urls", tap_url, "--decode-servers-urls", decode_url,
        ]  # fmt: skip
        print("$ " + " ".join(proxy_cmd))
        proxy_log = open(work / "proxy.log", "w")
        proxy_proc = subprocess.Popen(proxy_cmd, stdout=proxy_log, stderr=subprocess.STDOUT)
        procs.append(proxy_proc)
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        wait_http(f"{proxy_url}/health", proxy_proc, "the proxy", 120)

        checks = run_checks(args, iris, iris_url, proxy_url, recorder, store, work, served)
        (work / "exchanges.json").write_text(
            json.dumps(
                {"encoder": recorder.encoder_exchanges, "decode": recorder.decode_requests},
                indent=1,
            )
        )
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if recorder is not None:
            recorder.stop()
    print(f"recorded exchanges: {work / 'exchanges.json'}; logs: {work}/*.log")
    ok = checks.report()
    print("interop: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def wait_listening(proc: subprocess.Popen, timeout_s: float, log: Path) -> str:
    """The URL from iris serve's `listening on http://ADDR` line (it binds port 0)."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            match = re.search(r"listening on (http://\S+)", line)
            if match and not found:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not found:
        if proc.poll() is not None:
            sys.exit(f"iris serve exited with status {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    if not found:
        sys.exit(f"iris serve did not start within {timeout_s:.0f} s; see {log}")
    return found[0]


def run_checks(args, iris, iris_url, proxy_url, recorder, store, work, served) -> Checks:
    import torch
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    checks = Checks()
    images = make_images()
    (work / "images").mkdir()
    for name, data in images.items():
        (work / "images" / name).write_bytes(data)
    clips = load_clips()
    (work / "videos").mkdir()
    for name, data in clips.items():
        (work / "videos" / name).write_bytes(data)
    small_max_pixels = 56 * 56 * 4

    # ---- requests through the proxy -----------------------------------------------------
    # (name, body): each body's image parts, in order, are the items of that request.
    proxied = [
        (
            "five modes, no uuids",
            chat(
                [image_part(n, images[n]) for n in ("rgb.png", "rgba.png", "grey.png", "palette.png", "photo.jpg")],
                served,
            ),
        ),
        (
            "uuids, an image repeated in the request and one from the first request",
            chat(
                [
                    image_part("rgb.png", images["rgb.png"], "interop-rgb"),
                    image_part("photo.jpg", images["photo.jpg"], "interop-photo"),
                    image_part("photo.jpg", images["photo.jpg"], "interop-photo"),
                    image_part("grey.png", images["grey.png"]),
                    image_part("large.png", images["large.png"]),
                ],
                served,
            ),
        ),
        (
            "mm_processor_kwargs max_pixels, with and without uuid",
            chat(
                [
                    image_part("large.png", images["large.png"], "interop-large"),
                    image_part("rgba.png", images["rgba.png"]),
                ],
                served,
                mm_processor_kwargs={"max_pixels": small_max_pixels},
            ),
        ),
        (
            # The proxy sends each video in its own encoder request, the images together.
            "videos: an H.264 clip with a uuid, a VP9 clip, an image",
            chat(
                [
                    video_part("even10.mp4", clips["even10.mp4"], "interop-even"),
                    video_part("vp9_12.webm", clips["vp9_12.webm"]),
                    image_part("rgb.png", images["rgb.png"]),
                ],
                served,
            ),
        ),
    ]
    for name, body in proxied:
        before = len(recorder.encoder_exchanges)
        status, reply = http_json(
            "POST", f"{proxy_url}/v1/chat/completions", body, {"x-request-id": f"interop-{len(recorder.decode_requests)}"}
        )
        if status != 200:
            checks.fail("response", f"proxy request {name!r}: HTTP {status}: {str(reply)[:2000]}")
        if len(recorder.encoder_exchanges) == before:
            checks.fail("response", f"proxy request {name!r}: no encoder request reached iris")

    # ---- direct requests to iris (the proxy always sends uuids) ---------------------------
    direct = [
        ("direct, hashed", chat([image_part(n, images[n]) for n in images], served)),
        (
            "direct, hashed with max_pixels",
            chat(
                [image_part(n, images[n]) for n in ("large.png", "palette.png")],
                served,
                mm_processor_kwargs={"max_pixels": small_max_pixels},
            ),
        ),
        (
            "direct, media_io_kwargs background",
            chat(
                [image_part("rgba.png", images["rgba.png"])],
                served,
                media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}},
            ),
        ),
        ("direct, videos hashed", chat([video_part(n, clips[n]) for n in CLIP_NAMES], served)),
        (
            # A flat max_pixels reaches the video processor too (vLLM routes it to videos_kwargs).
            "direct, a video with max_pixels",
            chat([video_part("odd9.mp4", clips["odd9.mp4"])], served, mm_processor_kwargs={"max_pixels": 56 * 56}),
        ),
        (
            # A processor fps: a hash factor; the loader's frames are processed as they are.
            "direct, a video and an image with mm_processor_kwargs fps",
            chat(
                [video_part("vp9_12.webm", clips["vp9_12.webm"]), image_part("photo.jpg", images["photo.jpg"])],
                served,
                mm_processor_kwargs={"fps": 1},
            ),
        ),
        (
            "direct, a video sampled at 4 fps beside an image",
            chat(
                [video_part("even10.mp4", clips["even10.mp4"]), image_part("grey.png", images["grey.png"])],
                served,
                media_io_kwargs={"video": {"fps": 4}},
            ),
        ),
    ]
    direct_exchanges = []
    for name, body in direct:
        status, reply = http_json("POST", f"{iris_url}/v1/chat/completions", body)
        direct_exchanges.append({"request": body, "status": status, "reply": reply, "name": name})
        if status != 200:
            checks.fail("response", f"direct request {name!r}: HTTP {status}: {str(reply)[:2000]}")

    # Every exchange with iris: its media parts in order, the options, iris's reply.
    exchanges = [
        {"request": e["request"], "status": e["status"], "reply": e["reply"], "name": "via proxy"}
        for e in recorder.encoder_exchanges
    ] + direct_exchanges

    # ---- the replies --------------------------------------------------------------------
    # identifier -> (kind, grid, file name, options) for every item iris published
    published: dict[str, dict] = {}
    by_bytes = {data: name for name, data in (images | clips).items()}
    for ex in exchanges:
        if ex["status"] != 200:
            continue
        reply = ex["reply"]
        try:
            ChatCompletionResponse.model_validate(reply)
        except Exception as err:  # pydantic's ValidationError, named in the message
            checks.fail("response", f"{ex['name']}: not a valid ChatCompletionResponse: {err}")
        params = reply.get("ec_transfer_params") if isinstance(reply, dict) else None
        parts = media_parts(ex["request"])
        if not isinstance(params, dict):
            checks.fail("response", f"{ex['name']}: no ec_transfer_params in {json.dumps(reply)[:1000]}")
            continue
        seen_indices = {}
        for ident, entry in params.items():
            for k in entry.get("item_indices", []):
                seen_indices[k] = (ident, entry)
        for k, part in enumerate(parts):
            if k not in seen_indices:
                checks.fail("response", f"{ex['name']}: item {k} missing from ec_transfer_params {params}")
                continue
            ident, entry = seen_indices[k]
            kind = part_kind(part)
            if entry.get("modality") != kind:
                checks.fail("response", f"{ex['name']}: {ident}: modality {entry.get('modality')!r}, sent a {kind}")
            grid = (entry.get("metadata") or {}).get(f"{kind}_grid_thw")
            data = part_bytes(part)
            published[ident] = {
                "kind": kind,
                "grid": grid,
                "name": by_bytes.get(data),
                "mm_processor_kwargs": ex["request"].get("mm_processor_kwargs") or {},
                "media_io_kwargs": ex["request"].get("media_io_kwargs") or {},
                "uuid": part.get("uuid"),
                "bytes": data,
            }
            ex.setdefault("identifiers", {})[k] = ident
    checks.close("response", f"{len(exchanges)} iris replies valid ChatCompletionResponse with ec_transfer_params")

    # ---- (d) hashed identifiers against vLLM's hasher -----------------------------------
    hashed = 0
    for ex in exchanges:
        if ex["status"] != 200:
            continue
        request = ex["request"]
        for k, part in enumerate(media_parts(request)):
            got = ex.get("identifiers", {}).get(k)
            want = vllm_identifier(MultiModalHasher, ImageMediaIO, args, request, part)
            if part.get("uuid") is not None and want == part["uuid"]:
                continue  # a verbatim uuid, checked by (a)
            hashed += 1
            if got != want:
                checks.fail(
                    "(d) hashes",
                    f"{ex['name']} item {k} (uuid {part.get('uuid')!r}, "
                    f"mm_processor_kwargs {request.get('mm_processor_kwargs')}, "
                    f"media_io_kwargs {request.get('media_io_kwargs')}): iris {got}, vLLM {want}",
                )
    if hashed == 0:
        checks.fail("(d) hashes", "no hashed item was sent")
    checks.close("(d) hashes", f"{hashed} hashed identifiers equal vLLM's MultiModalHasher ({args.hasher}, model id {args.model_id!r})")

    # ---- (a) what the proxy forwarded ---------------------------------------------------
    # The proxy fans a request out (its images in one encoder request, each video in its own),
    # giving every item a uuid: an item's identifier is found by its bytes, uuid and options.
    encoded: dict[tuple, str] = {}
    for ex in exchanges:
        if ex["name"] != "via proxy" or ex["status"] != 200:
            continue
        options = json.dumps(ex["request"].get("mm_processor_kwargs") or {}, sort_keys=True)
        for j, part in enumerate(media_parts(ex["request"])):
            ident = ex.get("identifiers", {}).get(j)
            if ident is not None:
                encoded[(part_bytes(part), part.get("uuid"), options)] = ident
    rewritten = 0
    for (name, body), fwd in zip(proxied, recorder.decode_requests):
        sent = media_parts(body)
        fwd_parts = media_parts(fwd["request"])
        options = json.dumps(body.get("mm_processor_kwargs") or {}, sort_keys=True)
        if len(fwd_parts) != len(sent):
            checks.fail("(a) rewrite", f"request {name!r}: {len(sent)} media parts sent, {len(fwd_parts)} forwarded")
        for k, (orig, part) in enumerate(zip(sent, fwd_parts)):
            kind = part_kind(orig)
            if part.get("type") != f"{kind}_embeds":
                checks.fail("(a) rewrite", f"request {name!r} part {k}: a {kind} forwarded as {part.get('type')!r}: {json.dumps(part)[:300]}")
                continue
            ident = encoded.get((part_bytes(orig), part.get("uuid"), options))
            if ident is None:
                checks.fail("(a) rewrite", f"request {name!r} part {k}: no successful encoder exchange carried it (uuid {part.get('uuid')!r})")
                continue
            grid = published.get(ident, {}).get("grid")
            fwd_grid = (part.get(f"{kind}_embeds") or {}).get(f"{kind}_grid_thw")
            if fwd_grid != grid:
                checks.fail("(a) rewrite", f"request {name!r} part {k}: forwarded grid {fwd_grid}, iris returned {grid}")
            # The identifier the consumer computes from the forwarded part: the uuid, or vLLM's
            # hash of it with the request's factors (the same function for both modalities).
            consumer_id = vllm_identifier(MultiModalHasher, ImageMediaIO, args, fwd["request"], part)
            if consumer_id != ident:
                checks.fail("(a) rewrite", f"request {name!r} part {k}: consumer identifier {consumer_id}, iris wrote {ident}")
            if not (store / consumer_id / "encoder_cache.safetensors").is_file():
                checks.fail("(a) rewrite", f"request {name!r} part {k}: no file for {consumer_id}")
            rewritten += 1
    if len(recorder.decode_requests) != len(proxied):
        checks.fail("(a) rewrite", f"{len(proxied)} requests sent, {len(recorder.decode_requests)} reached the decode server")
    checks.close("(a) rewrite", f"{rewritten} forwarded parts are image_embeds/video_embeds with iris's grid and a written file's identifier")

    # ---- (b) every file through vLLM's ECExampleConnector -------------------------------
    loaded = load_through_connector(store, checks)
    for ident, tensor in loaded.items():
        info = published.get(ident)
        if info is None:
            checks.fail("(b) connector", f"{ident}: a file no reply named")
            continue
        t, h, w = info["grid"]
        if tensor.dtype != torch.bfloat16 or tensor.dim() != 2 or tensor.shape[0] != t * h * w // 4:
            checks.fail("(b) connector", f"{ident}: {tuple(tensor.shape)} {tensor.dtype}, grid {info['grid']} wants [{t * h * w // 4}, width] bf16")
    for ident in published:
        if ident not in loaded:
            checks.fail("(b) connector", f"{ident}: named in a reply, no file")
    widths = sorted({tuple(t.shape)[1] for t in loaded.values()})
    checks.close("(b) connector", f"{len(loaded)} files load through ECExampleConnector.start_load_caches, [t*h*w/4, {widths}] bf16")

    # ---- (c) rows against iris encode ---------------------------------------------------
    compared = encode_and_compare(iris, args, published, loaded, work, checks)
    checks.close("(c) rows", f"{compared} files equal iris encode --dtype {args.dtype} bit for bit")

    # ---- refusals -----------------------------------------------------------------------
    before = sorted(p.name for p in store.iterdir())
    bad = [
        ("bad base64", chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], served)),
        ("unsupported part", chat([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], served)),
        ("corrupt video", chat([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], served)),
        ("uuid with a slash", chat([image_part("rgb.png", images["rgb.png"], "../escape")], served)),
        ("not an image", chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}}], served)),
    ]  # fmt: skip
    for name, body in bad:
        status, reply = http_json("POST", f"{iris_url}/v1/chat/completions", body)
        if not (400 <= status < 500 and isinstance(reply, dict)):
            checks.fail("refusals", f"{name}: HTTP {status} {str(reply)[:300]}")
    status, reply = http_json("POST", f"{iris_url}/v1/chat/completions", chat([image_part("rgb.png", images["rgb.png"])], "another-model"))
    if status != 404:
        checks.fail("refusals", f"wrong model name: HTTP {status} {str(reply)[:300]}")
    status, models = http_json("GET", f"{iris_url}/v1/models")
    if status != 200 or served not in [m.get("id") for m in models.get("data", [])]:
        checks.fail("refusals", f"GET /v1/models: HTTP {status} {models}")
    after = sorted(p.name for p in store.iterdir())
    if after != before:
        checks.fail("refusals", f"the store changed: {sorted(set(after) ^ set(before))}")
    checks.close("refusals", f"{len(bad) + 1} bad requests got 4xx JSON, no file left; /v1/models names {served!r}")
    return checks


def media_parts(request: dict) -> list[dict]:
    return [
        p for m in request.get("messages", []) if isinstance(m.get("content"), list)
        for p in m["content"] if p.get("type") != "text"
    ]  # fmt: skip


def vllm_identifier(hasher, media_io, args, request: dict, part: dict) -> str:
    """The identifier vLLM 0.33 gives an online image or video part, as
    `ProcessorInputs.get_mm_hashes` computes it: the uuid verbatim when the item's modality has
    no hash factors, else `MultiModalHasher.hash_kwargs` over the uuid, or over what the media
    loader makes of the bytes (`ImageMediaIO`; `VideoMediaIO` with the model's video loader),
    with the modality's `media_io_kwargs` and the processor kwargs not scoped to another
    modality."""
    kind = part_kind(part)
    factors = {}
    io_kwargs = (request.get("media_io_kwargs") or {}).get(kind) or {}
    if io_kwargs:
        factors["media_io_kwargs"] = {kind: io_kwargs}
    others = {"images_kwargs", "videos_kwargs", "audio_kwargs"} - {f"{kind}s_kwargs"}
    proc_kwargs = {k: v for k, v in (request.get("mm_processor_kwargs") or {}).items() if k not in others}
    if proc_kwargs:
        factors["mm_processor_kwargs"] = proc_kwargs
    uuid = part.get("uuid")
    if uuid is not None and not factors:
        return uuid
    if uuid is not None:
        item = uuid
    elif kind == "image":
        item = media_io(**io_kwargs).load_bytes(part_bytes(part))
    else:
        item = vllm_video_item(args, io_kwargs, part_bytes(part))
    return hasher.hash_kwargs(args.hasher, model_id=args.model_id, **{kind: item}, **factors)


def vllm_video_item(args, io_kwargs: dict, data: bytes):
    """What vLLM hashes for a video: `VideoMediaIO`'s item (the loader's frames and metadata,
    with the original bytes) as `MultiModalDataParser` hands it to the hasher."""
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO
    from vllm.multimodal.parse import MultiModalDataParser

    loaded = VideoMediaIO(ImageMediaIO(), video_backend=args.video_loader, **io_kwargs).load_bytes(data)
    parsed = MultiModalDataParser(video_needs_metadata=False).parse_mm_data({"video": [loaded]})
    return parsed["video"].get_all_items_for_hash()[0]


def load_through_connector(store: Path, checks: Checks) -> dict:
    """Every entry, loaded by vLLM's ECExampleConnector as a consumer's worker loads it."""
    from vllm.config import ECTransferConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnector,
        ECExampleConnectorMetadata,
        MMMeta,
    )

    config = VllmConfig(
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECExampleConnector",
            ec_role="ec_consumer",
            ec_connector_extra_config={"shared_storage_path": str(store)},
        )
    )
    scheduler = ECExampleConnector(config, ECConnectorRole.SCHEDULER)
    worker = ECExampleConnector(config, ECConnectorRole.WORKER)
    loaded = {}
    for entry in sorted(store.iterdir()):
        files = sorted(p.name for p in entry.iterdir()) if entry.is_dir() else None
        if files != ["encoder_cache.safetensors"]:
            checks.fail("(b) connector", f"{entry.name}: holds {files}, want only encoder_cache.safetensors")
            continue
        if not scheduler.has_cache_item(entry.name):
            checks.fail("(b) connector", f"{entry.name}: has_cache_item says no")
            continue
        meta = ECExampleConnectorMetadata()
        meta.add_mm_data(MMMeta.make_meta(entry.name, 0))
        worker.bind_connector_metadata(meta)
        cache: dict = {}
        try:
            worker.start_load_caches(cache)
        except Exception as err:
            checks.fail("(b) connector", f"{entry.name}: start_load_caches: {err!r}")
            continue
        finally:
            worker.clear_connector_metadata()
        loaded[entry.name] = cache[entry.name]
    return loaded


def encode_and_compare(iris, args, published, loaded, work, checks, check="(c) rows") -> int:
    """Runs `iris encode` once per distinct processor setting and compares rows bit for bit.

    `published` maps identifiers to their kind (`image` or `video`), file name (under
    `work/images` or `work/videos`) and options, `loaded` to the tensor received for them;
    failures are reported under `check`. A video's `media_io_kwargs.video.fps` is `iris encode
    --video-fps`; items with other media options are not compared (iris encode has none).
    """
    import torch
    from safetensors.torch import load_file

    def encodable(info: dict) -> bool:
        # Only the item's own modality's options apply to it.
        options = info["media_io_kwargs"].get(info["kind"]) or {}
        return not options or (info["kind"] == "video" and set(options) == {"fps"})

    groups: dict[str, list[str]] = {}
    for ident, info in published.items():
        if ident not in loaded or not encodable(info):
            continue
        fps = (info["media_io_kwargs"].get("video") or {}).get("fps") if info["kind"] == "video" else None
        key = json.dumps({"proc": info["mm_processor_kwargs"], "fps": fps}, sort_keys=True)
        groups.setdefault(key, []).append(ident)
    skipped = [i for i, info in published.items() if not encodable(info)]
    if skipped:
        print(f"(c) not compared (iris encode has no such media_io_kwargs): {len(skipped)} item(s)")
    compared = 0
    for n, (key, idents) in enumerate(groups.items()):
        options = json.loads(key)
        extra = []
        for opt in ("min_pixels", "max_pixels"):
            if opt in options["proc"]:
                extra += [f"--{opt.replace('_', '-')}", str(options["proc"][opt])]
        if options["fps"] is not None:
            extra += ["--video-fps", str(options["fps"])]
        names = {
            kind: sorted({published[i]["name"] for i in idents if published[i]["kind"] == kind})
            for kind in ("image", "video")
        }
        out = work / f"encode-{n}.safetensors"
        cmd = [str(iris), "encode", "--model", args.model, "--dtype", args.dtype, "--out", str(out), *extra]
        cmd += [str(work / "images" / name) for name in names["image"]]
        for name in names["video"]:
            cmd += ["--video", str(work / "videos" / name)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            checks.fail(check, f"{' '.join(cmd)}: status {run.returncode}: {run.stderr[-1500:]}")
            continue
        tensors = load_file(str(out))
        for ident in idents:
            info = published[ident]
            ref = tensors[f"{info['kind']}.{names[info['kind']].index(info['name'])}"]
            got = loaded[ident]
            if ref.dtype != torch.float32:
                checks.fail(check, f"iris encode wrote {ref.dtype}, expected f32")
                continue
            if not torch.equal(ref.to(torch.bfloat16).to(torch.float32), ref):
                checks.fail(check, f"{ident}: iris encode's f32 values are not bf16 values")
            if tuple(got.shape) != tuple(ref.shape) or not torch.equal(got.to(torch.float32), ref):
                diff = (
                    (got.to(torch.float32) - ref).abs().max().item()
                    if tuple(got.shape) == tuple(ref.shape)
                    else "shape"
                )
                checks.fail(
                    check,
                    f"{ident} ({info['kind']} {info['name']}, {key}): file {tuple(got.shape)} vs "
                    f"iris encode {tuple(ref.shape)}, max abs diff {diff}",
                )
            compared += 1
    return compared


if __name__ == "__main__":
    sys.exit(main())
