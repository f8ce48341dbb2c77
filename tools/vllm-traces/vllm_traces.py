#!/usr/bin/env python3
"""Drive vLLM's real v1 scheduler on `iris simulate` workloads and record its decisions per step.

Modes (see README.md beside this file):

  vllm_traces.py --workload W.jsonl --out T.jsonl [scheduler flags] [--about TEXT]
      run vLLM on one workload and write a trace (header, requests, steps, end)
  vllm_traces.py --regenerate T.jsonl ...
      re-run vLLM on each trace's own workload and configuration and rewrite it
  vllm_traces.py --verify T.jsonl ...
      re-run vLLM on each trace and report whether the file still matches
  vllm_traces.py --random N [--seed S] [--iris PATH] [--keep DIR]
      generate N workloads, run vLLM and `iris simulate` on each, compare every step

The scheduler runs on the CPU with no model: a text-only model configuration written to a
temporary folder, the encoder budget set from vLLM's own `compute_mm_encoder_budget`, a KV cache
of one full-attention group without prefix caching, and requests with `max_tokens = 1` (iris
ends where the language model's prefill begins, so a request finishes with its prompt).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

VLLM_VERSION = "0.33.0"
DEFAULT_BLOCK_SIZE = 16

# Scheduler settings a trace records; names and defaults are `iris simulate`'s.
CONFIG_DEFAULTS = {
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "encoder_cache_size": None,
    "disable_chunked_mm_input": False,
    "kv_block_size": DEFAULT_BLOCK_SIZE,
    "num_kv_blocks": None,
}


def _import_vllm():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        sys.exit(
            f"vllm {vllm.__version__} is installed; the traces are recorded against "
            f"{VLLM_VERSION} (pip install --no-deps vllm=={VLLM_VERSION})"
        )
    return vllm


def largest_item(workload, config):
    """The per-item maximum iris's simulator derives the budget from."""
    largest = max(
        (item_embeds(i) for r in workload for i in r.get("items", [])), default=0
    )
    if config["disable_chunked_mm_input"]:
        largest = min(largest, config["max_num_batched_tokens"])
    return largest


def item_embeds(item):
    if item.get("embed_runs"):
        return sum(e - s for s, e in item["embed_runs"])
    return item.get("embeds", item["length"])


def item_mask(item):
    """The item's `is_embed` mask as a list of bools, or None when every position is one."""
    length = item["length"]
    runs = item.get("embed_runs")
    if runs is None:
        embeds = item.get("embeds", length)
        if embeds >= length:
            return None
        runs = [(0, embeds)]
    mask = [False] * length
    for s, e in runs:
        for p in range(s, e):
            mask[p] = True
    return mask


class VllmRun:
    """One workload through vLLM's `Scheduler`, stepped as `iris simulate` steps it."""

    def __init__(self, workload, config, folder):
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.v1.core.encoder_cache_manager import (
            EncoderCacheManager,
            compute_mm_encoder_budget,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        self.torch = torch
        self.workload = workload
        self.config = config
        block_size = config["kv_block_size"]
        num_blocks = config["num_kv_blocks"]
        if num_blocks is None:
            # Unlimited in effect: every prompt at once, plus the null block.
            num_blocks = 2 + sum(
                -(-r["prompt_len"] // block_size) for r in workload
            )
        max_model_len = 1 << 24
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 4,
                    "num_hidden_layers": 1,
                    "vocab_size": 1000,
                    "max_position_embeddings": max_model_len,
                    "torch_dtype": "float32",
                },
                f,
            )
        model = ModelConfig(
            model=folder,
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            dtype="float32",
        )
        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=config["max_num_batched_tokens"],
            max_num_seqs=config["max_num_seqs"],
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            disable_chunked_mm_input=config["disable_chunked_mm_input"],
            async_scheduling=False,
        )
        if config["encoder_cache_size"] is not None:
            sched_cfg.encoder_cache_size = config["encoder_cache_size"]
        cache = CacheConfig(block_size=block_size, enable_prefix_caching=False)
        cache.num_gpu_blocks = num_blocks
        vllm_config = VllmConfig(
            model_config=model,
            scheduler_config=sched_cfg,
            cache_config=cache,
            device_config=DeviceConfig(device="cpu"),
        )
        kv = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["layer"],
                    FullAttentionSpec(
                        block_size=block_size,
                        num_kv_heads=1,
                        head_size=1,
                        dtype=torch.float32,
                    ),
                )
            ],
        )
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
        )
        # The budget vLLM derives from the model's largest item, here the workload's: the
        # scheduler's own derivation needs a multimodal model's processor.
        # A workload without images is a model without multimodal input: no maximum at all
        # (iris's budget treats a zero maximum the same way).
        largest = largest_item(workload, config)
        compute, cache_size = compute_mm_encoder_budget(
            vllm_config.scheduler_config,
            {"image": largest} if largest > 0 else {},
        )
        self.compute_budget = compute
        self.cache_size = cache_size
        self.scheduler.max_num_encoder_input_tokens = compute
        self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size)

    def _request(self, r):
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        features = []
        for item in r.get("items", []):
            mask = item_mask(item)
            features.append(
                MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=item["hash"],
                    mm_position=PlaceholderRange(
                        offset=item["offset"],
                        length=item["length"],
                        is_embed=None
                        if mask is None
                        else self.torch.tensor(mask, dtype=self.torch.bool),
                    ),
                    mm_hash=item["hash"],
                )
            )
        return Request(
            request_id=r["id"],
            prompt_token_ids=[1] * r["prompt_len"],
            sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
            pooling_params=None,
            mm_features=features or None,
            arrival_time=0.0,
        )

    def _unfinished(self):
        running, waiting = self.scheduler.get_request_counts()
        return running + waiting > 0

    def run(self):
        """Yields one record per step, then `("end", {...})`."""
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        s = self.scheduler
        workload = self.workload
        order = sorted(range(len(workload)), key=lambda i: workload[i].get("arrival_step", 0))
        aborts = sorted(
            (r["abort_step"], w)
            for w, r in enumerate(workload)
            if r.get("abort_step") is not None
        )
        finished_at = {}
        added = set()
        nxt = next_abort = step = 0
        while nxt < len(order) or self._unfinished():
            if not self._unfinished():
                step = max(step, workload[order[nxt]].get("arrival_step", 0))
            while nxt < len(order) and workload[order[nxt]].get("arrival_step", 0) <= step:
                r = workload[order[nxt]]
                s.add_request(self._request(r))
                added.add(r["id"])
                nxt += 1
            while next_abort < len(aborts) and aborts[next_abort][0] <= step:
                w = aborts[next_abort][1]
                next_abort += 1
                rid = workload[w]["id"]
                if rid in added and rid not in finished_at:
                    s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                    finished_at[rid] = step
            out = s.schedule()
            free_slots = s.encoder_cache_manager.num_free_slots
            freeable_slots = s.encoder_cache_manager.num_freeable_slots
            free_blocks = s.kv_cache_manager.block_pool.get_num_free_blocks()
            req_ids = list(out.num_scheduled_tokens)
            sampled = []
            for rid in req_ids:
                req = s.requests[rid]
                # A prefill chunk that completes the prompt samples its one token.
                sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
            engine_outputs = s.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                ),
            )
            finished = [
                o.request_id
                for outs in engine_outputs.values()
                for o in outs.outputs
                if o.finish_reason is not None
            ]
            for rid in finished:
                finished_at[rid] = step
            assert not s.kv_holding_waiting, "no request should hold KV blocks while waiting"
            record = {
                "step": step,
                "scheduled": [[rid, n] for rid, n in out.num_scheduled_tokens.items()],
                "encoder_inputs": {
                    rid: list(ids) for rid, ids in sorted(out.scheduled_encoder_inputs.items())
                },
                "preempted": sorted(out.preempted_req_ids),
                "finished": finished,
                "freed": list(out.free_encoder_mm_hashes),
                "free_slots": free_slots,
                "freeable_slots": freeable_slots,
            }
            if self.config["num_kv_blocks"] is not None:
                record["free_kv_blocks"] = free_blocks
            record["running"] = [r.request_id for r in s.running]
            record["waiting"] = [r.request_id for r in s.waiting]
            yield "step", record
            if not out.num_scheduled_tokens and not out.preempted_req_ids:
                # Nothing moved: only an arrival or an abort changes the state.
                arrival = (
                    workload[order[nxt]].get("arrival_step", 0) if nxt < len(order) else None
                )
                abort = next(
                    (a for a, w in aborts[next_abort:] if workload[w]["id"] not in finished_at),
                    None,
                )
                events = [e for e in (arrival, abort) if e is not None]
                if events:
                    step = max(min(events), step + 1)
                elif self._unfinished():
                    yield "end", {"stalled": True, "step": step}
                    return
                else:
                    step += 1
            else:
                step += 1
        yield "end", {"stalled": False, "step": step - 1}


def run_vllm(workload, config):
    with tempfile.TemporaryDirectory() as folder:
        run = VllmRun(workload, config, folder)
        lines = list(run.run())
        return run, lines


def write_trace(path, workload, config, about, run, lines):
    with open(path, "w") as f:
        header = {
            "vllm_version": VLLM_VERSION,
            "about": about,
            "config": config,
            "encoder_compute_budget": run.compute_budget,
            "encoder_cache_size": run.cache_size,
        }
        f.write(json.dumps({"trace": header}, separators=(",", ":")) + "\n")
        for r in workload:
            f.write(json.dumps({"request": r}, separators=(",", ":")) + "\n")
        for kind, body in lines:
            f.write(json.dumps({kind: body}, separators=(",", ":")) + "\n")


def read_trace(path):
    header, workload, lines = None, [], []
    with open(path) as f:
        for raw in f:
            if not raw.strip():
                continue
            obj = json.loads(raw)
            (kind, body), = obj.items()
            if kind == "trace":
                header = body
            elif kind == "request":
                workload.append(body)
            else:
                lines.append((kind, body))
    if header is None:
        sys.exit(f"{path}: no trace header line")
    config = dict(CONFIG_DEFAULTS)
    config.update(header["config"])
    return header, workload, config, lines


def read_workload(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def config_from_args(args):
    return {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "encoder_cache_size": args.encoder_cache_size,
        "disable_chunked_mm_input": args.disable_chunked_mm_input,
        "kv_block_size": args.kv_block_size,
        "num_kv_blocks": args.num_kv_blocks,
    }


def iris_flags(config, policy="vllm"):
    flags = [
        "--max-num-batched-tokens", str(config["max_num_batched_tokens"]),
        "--max-num-seqs", str(config["max_num_seqs"]),
        "--kv-block-size", str(config["kv_block_size"]),
        "--scheduler-policy", policy,
    ]
    if config["encoder_cache_size"] is not None:
        flags += ["--encoder-cache-size", str(config["encoder_cache_size"])]
    if config["num_kv_blocks"] is not None:
        flags += ["--num-kv-blocks", str(config["num_kv_blocks"])]
    if config["disable_chunked_mm_input"]:
        flags.append("--disable-chunked-mm-input")
    return flags


def run_iris(iris, workload, config, folder, policy="vllm"):
    """Runs `iris simulate`; returns its step records and whether it stalled."""
    wpath = os.path.join(folder, "workload.jsonl")
    spath = os.path.join(folder, "iris-steps.jsonl")
    with open(wpath, "w") as f:
        for r in workload:
            f.write(json.dumps(r) + "\n")
    proc = subprocess.run(
        [iris, "simulate", "--workload", wpath, "--steps-out", spath, "--json"]
        + iris_flags(config, policy),
        capture_output=True,
        text=True,
    )
    stalled = proc.returncode != 0 and "stalled" in proc.stderr
    if not os.path.exists(spath):
        raise RuntimeError(f"iris simulate wrote no steps: {proc.stderr.strip()}")
    if proc.returncode != 0 and not stalled:
        raise RuntimeError(f"iris simulate failed: {proc.stderr.strip()}")
    with open(spath) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return steps, stalled


def compare(vllm_lines, iris_steps, iris_stalled):
    """The first difference as text, or None."""
    vllm_steps = [body for kind, body in vllm_lines if kind == "step"]
    end = next(body for kind, body in vllm_lines if kind == "end")
    previous = None
    for v, i in zip(vllm_steps, iris_steps):
        if v != i:
            return (
                f"step {v['step']} differs\n  state before: "
                f"{json.dumps(previous) if previous else 'none (first step)'}\n"
                f"  vllm: {json.dumps(v)}\n  iris: {json.dumps(i)}"
            )
        previous = {k: v[k] for k in ("running", "waiting", "free_slots", "freeable_slots")}
    if len(vllm_steps) != len(iris_steps):
        return f"vllm ran {len(vllm_steps)} steps, iris {len(iris_steps)}"
    if end["stalled"] != iris_stalled:
        return f"vllm stalled: {end['stalled']}, iris stalled: {iris_stalled}"
    return None


# Token geometry of the Qwen vision towers: patch x spatial merge, in pixels per embedding side.
GEOMETRY = {"qwen2-vl": 28, "qwen3-vl": 32}
RESOLUTIONS = [(224, 224), (448, 336), (640, 480), (672, 672), (896, 896), (1280, 720)]


def random_case(rng, index, **opts):
    """One random workload and configuration, always schedulable by both sides.

    `opts` pins what the corpus needs: `mnbt`, `seqs`, `unchunked`, `geometry` ("qwen2-vl",
    "qwen3-vl" or "mixed"), `cache` ("default", "small", "one" or "large"), `kv` ("tiny" or
    None), `long`, `abort` (probability), `requests` (count) and `repeat` (probability of an
    image repeated within a request).
    """
    mnbt = opts.get("mnbt") or rng.choice([256, 512, 1024, 2048, 4096, 8192])
    config = dict(CONFIG_DEFAULTS)
    config["max_num_batched_tokens"] = mnbt
    config["max_num_seqs"] = opts.get("seqs") or rng.choice([1, 2, 4, 8, 16, 32])
    unchunked = opts.get("unchunked")
    config["disable_chunked_mm_input"] = rng.random() < 0.4 if unchunked is None else unchunked
    geometry = opts.get("geometry") or rng.choice(list(GEOMETRY))
    images = []
    for k in range(rng.randint(2, 12)):
        g = rng.choice(list(GEOMETRY)) if geometry == "mixed" else geometry
        side = GEOMETRY[g]
        w, h = rng.choice(RESOLUTIONS)
        tokens = (w // side) * (h // side)
        if config["disable_chunked_mm_input"]:
            tokens = min(tokens, mnbt - 2)
        # Qwen3-VL-style placeholders carry their start and end markers as non-embeddings.
        framed = g == "qwen3-vl" and rng.random() < 0.3
        images.append((f"img{index}-{k}", tokens, framed))
    largest = max(t for _, t, _ in images)
    cache = opts.get("cache") or rng.choice(["default", "small", "one", "large"])
    config["encoder_cache_size"] = {
        "default": None,
        "small": max(1, largest // 2),
        "one": largest,
        "large": largest * rng.choice([2, 6]),
    }[cache]
    requests = []
    step = 0
    long_prompts = opts.get("long", rng.random() < 0.3)
    abort = opts.get("abort", 0.1)
    repeat = opts.get("repeat", 0.15)
    count = opts.get("requests") or rng.randint(2, 14)
    for r in range(count):
        items, pos = [], 0
        n_items = rng.choice([0, 1, 1, 2, 2, 3, 4])
        for _ in range(n_items):
            pos += rng.randint(0, 120)
            name, tokens, framed = rng.choice(images)
            if items and rng.random() < repeat:
                name, tokens, framed = next(
                    (n, t, f) for n, t, f in images if n == items[-1]["hash"]
                )
            item = {"hash": name, "offset": pos, "length": tokens + (2 if framed else 0)}
            if framed:
                item["embed_runs"] = [[1, tokens + 1]]
            items.append(item)
            pos += item["length"]
        tail = rng.randint(1, 3000 if long_prompts else 200)
        req = {"id": f"r{r}", "arrival_step": step, "prompt_len": pos + tail, "items": items}
        if rng.random() < abort:
            req["abort_step"] = step + rng.randint(0, 4)
        requests.append(req)
        step += rng.choice([0, 0, 1, 2])
    kv = opts.get("kv", "tiny" if rng.random() < 0.3 else None)
    if kv == "tiny":
        bs = DEFAULT_BLOCK_SIZE
        need = max(-(-r["prompt_len"] // bs) for r in requests)
        config["num_kv_blocks"] = need + 1 + rng.randint(0, need // 2)
    return requests, config


# The committed corpus: name, what it covers, seed, and what the case pins.
CORPUS = [
    ("chunked-512-4seqs-cache1024", "chunked, budget 512, 4 running, cache 1024 tokens", 101, dict(mnbt=512, seqs=4, unchunked=False, cache="large")),
    ("unchunked-2048-16seqs", "unchunked, budget 2048, 16 running", 102, dict(mnbt=2048, seqs=16, unchunked=True)),
    ("unchunked-4096-many-steps", "unchunked, budget 4096, many requests", 103, dict(mnbt=4096, seqs=8, unchunked=True, requests=14, long=True)),
    ("chunked-512-16seqs-cache1200", "chunked, budget 512, 16 running, a cache of about two images", 104, dict(mnbt=512, seqs=16, unchunked=False, cache="large")),
    ("budget-256-chunked", "smallest budget, chunked", 105, dict(mnbt=256, unchunked=False)),
    ("budget-256-unchunked", "smallest budget, unchunked", 106, dict(mnbt=256, unchunked=True)),
    ("budget-8192-chunked", "largest budget, chunked", 107, dict(mnbt=8192, unchunked=False, requests=12)),
    ("budget-8192-unchunked", "largest budget, unchunked", 108, dict(mnbt=8192, unchunked=True, requests=12)),
    ("one-seq", "one running sequence", 109, dict(seqs=1)),
    ("two-seqs-unchunked", "two running sequences, unchunked", 110, dict(seqs=2, unchunked=True)),
    ("32-seqs", "32 running sequences", 111, dict(seqs=32, mnbt=8192, requests=14)),
    ("cache-smaller-than-an-image", "encoder cache asked below one image (raised to the largest item)", 112, dict(cache="small")),
    ("cache-smaller-unchunked", "encoder cache asked below one image, unchunked", 113, dict(cache="small", unchunked=True)),
    ("cache-one-image", "encoder cache equal to the largest image", 114, dict(cache="one")),
    ("cache-one-image-1024", "cache of one image, budget 1024", 115, dict(cache="one", mnbt=1024)),
    ("cache-large", "large encoder cache", 116, dict(cache="large", mnbt=2048)),
    ("shared-images", "few distinct images, shared between requests", 117, dict(requests=14, repeat=0.0)),
    ("repeated-within-request", "the same image repeated within requests", 118, dict(repeat=0.8)),
    ("repeated-unchunked", "repeated images, unchunked", 119, dict(repeat=0.8, unchunked=True)),
    ("long-prompts", "long text prompts", 120, dict(long=True, mnbt=1024)),
    ("long-prompts-unchunked", "long prompts, unchunked", 121, dict(long=True, unchunked=True, mnbt=2048)),
    ("preemption-tiny-kv", "a KV cache barely above one prompt: preemption", 122, dict(kv="tiny", seqs=8, mnbt=1024)),
    ("preemption-tiny-kv-unchunked", "tiny KV cache, unchunked", 221, dict(kv="tiny", seqs=8, unchunked=True, mnbt=2048)),
    ("preemption-long", "tiny KV cache, long prompts", 205, dict(kv="tiny", long=True, seqs=16)),
    ("preemption-small-budget", "tiny KV cache, budget 256", 200, dict(kv="tiny", mnbt=256, seqs=4)),
    ("aborts-mid-prefill", "aborted requests, some mid-prefill", 126, dict(abort=0.5, long=True, mnbt=512)),
    ("aborts-unchunked", "aborts, unchunked", 127, dict(abort=0.5, unchunked=True, long=True)),
    ("qwen2-vl-geometry", "Qwen2-VL token geometry (28-pixel embeddings)", 128, dict(geometry="qwen2-vl")),
    ("qwen3-vl-geometry", "Qwen3-VL token geometry (32-pixel embeddings, framed placeholders)", 129, dict(geometry="qwen3-vl")),
    ("mixed-geometry", "Qwen2-VL and Qwen3-VL images in one workload", 130, dict(geometry="mixed", requests=12)),
    ("mixed-geometry-unchunked", "mixed geometry, unchunked", 131, dict(geometry="mixed", unchunked=True)),
    ("vllm-starves-a-large-image", "vLLM starves a waiting image as large as the cache behind a stream of smaller ones (progress serves it in 2 steps)", None, dict(build="starvation")),
]


def starvation_case():
    """A request whose one image fills the whole cache arrives behind a stream of requests with
    smaller images. vLLM sets it aside while any smaller image is held and admits the requests
    behind it, which keep the space held, so it waits until the stream ends; the progress policy
    reserves the space it was refused and serves it at once."""
    config = dict(CONFIG_DEFAULTS)
    config.update(max_num_batched_tokens=512, encoder_cache_size=1000)
    workload = [{"id": "s0", "arrival_step": 0, "prompt_len": 750,
                 "items": [{"hash": "small0", "offset": 100, "length": 600}]}]
    workload.append({"id": "big", "arrival_step": 1, "prompt_len": 1000,
                     "items": [{"hash": "big", "offset": 0, "length": 1000}]})
    for k in range(1, 24):
        workload.append({"id": f"s{k}", "arrival_step": k, "prompt_len": 750,
                         "items": [{"hash": f"small{k}", "offset": 100, "length": 600}]})
    return workload, config


def corpus_case(seed, opts):
    if opts.get("build") == "starvation":
        return starvation_case()
    return random_case(random.Random(seed), seed, **opts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--workload", help="workload JSONL (iris simulate's format)")
    mode.add_argument("--regenerate", nargs="+", metavar="TRACE", help="re-run and rewrite traces")
    mode.add_argument("--verify", nargs="+", metavar="TRACE", help="re-run and check traces")
    mode.add_argument("--random", type=int, metavar="N", help="compare vLLM and iris on N random workloads")
    mode.add_argument("--corpus", metavar="DIR", help="write the committed corpus of traces into DIR")
    p.add_argument("--out", help="trace to write (with --workload)")
    p.add_argument("--about", default="", help="what the trace covers (with --workload)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--encoder-cache-size", type=int)
    p.add_argument("--disable-chunked-mm-input", action="store_true")
    p.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--seed", type=int, default=1, help="first seed (with --random)")
    p.add_argument("--iris", default="target/release/iris", help="iris binary (with --random)")
    p.add_argument("--keep", help="folder for workloads that disagree (with --random)")
    p.add_argument(
        "--iris-policy",
        default="vllm",
        choices=["vllm", "progress"],
        help="iris's scheduler policy (with --random; progress shows where it departs)",
    )
    args = p.parse_args()
    _import_vllm()

    if args.workload:
        if not args.out:
            p.error("--workload needs --out")
        workload = read_workload(args.workload)
        config = config_from_args(args)
        run, lines = run_vllm(workload, config)
        write_trace(args.out, workload, config, args.about, run, lines)
        steps = sum(1 for k, _ in lines if k == "step")
        print(f"{args.out}: {steps} steps")
    elif args.corpus:
        os.makedirs(args.corpus, exist_ok=True)
        for name, about, seed, opts in CORPUS:
            workload, config = corpus_case(seed, opts)
            run, lines = run_vllm(workload, config)
            path = os.path.join(args.corpus, f"{name}.jsonl")
            write_trace(path, workload, config, about, run, lines)
            steps = [b for k, b in lines if k == "step"]
            end = lines[-1][1]
            print(
                f"{path}: {len(steps)} steps, "
                f"{sum(len(b['preempted']) for b in steps)} preemptions, "
                f"{sum(1 for r in workload if 'abort_step' in r)} aborts, "
                f"{'stalled' if end['stalled'] else 'finished'}"
            )
    elif args.regenerate:
        for path in args.regenerate:
            header, workload, config, _ = read_trace(path)
            run, lines = run_vllm(workload, config)
            write_trace(path, workload, config, header.get("about", ""), run, lines)
            print(f"{path}: {sum(1 for k, _ in lines if k == 'step')} steps")
    elif args.verify:
        bad = 0
        for path in args.verify:
            _, workload, config, recorded = read_trace(path)
            _, lines = run_vllm(workload, config)
            same = [list(x) for x in lines] == [list(x) for x in recorded]
            bad += not same
            print(f"{path}: {'matches' if same else 'DIFFERS from'} vLLM {VLLM_VERSION}")
        sys.exit(1 if bad else 0)
    else:
        if not os.path.exists(args.iris):
            sys.exit(f"{args.iris} not found: build it (cargo build --release -p iris) or pass --iris")
        agree = 0
        for n in range(args.random):
            seed = args.seed + n
            workload, config = random_case(random.Random(seed), seed)
            _, lines = run_vllm(workload, config)
            with tempfile.TemporaryDirectory() as folder:
                steps, stalled = run_iris(args.iris, workload, config, folder, args.iris_policy)
            diff = compare(lines, steps, stalled)
            if diff is None:
                agree += 1
                continue
            print(f"seed {seed}: {diff}")
            if args.keep:
                os.makedirs(args.keep, exist_ok=True)
                path = os.path.join(args.keep, f"seed-{seed}.jsonl")
                with tempfile.TemporaryDirectory() as folder:
                    run = VllmRun(workload, config, folder)
                write_trace(path, workload, config, f"random seed {seed}", run, lines)
                print(f"  kept as {path}")
        print(f"{agree} of {args.random} random workloads agree step for step")
        sys.exit(0 if agree == args.random else 1)


if __name__ == "__main__":
    main()
