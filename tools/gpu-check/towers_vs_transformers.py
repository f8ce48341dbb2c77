#!/usr/bin/env python3
"""Vision towers in bf16 on one GPU: iris's CUDA device against transformers, at steady state.

Towers: Qwen2-VL-2B, Qwen2.5-VL-7B and Qwen3-VL-8B, random weights on both sides (the machine
has no model download), built from their published vision hyperparameters (the iris presets of
core/src/model/presets.rs). transformers runs with its best attention: flash_attention_2 when
the flash-attn package is installed, else sdpa. Inputs: batches of 1, 4 and 32 images of
448x448 (32 being the default 8192-token step of the Qwen2 towers), the same generated image
repeated, preprocessed by transformers' Qwen2-VL image processor; iris encodes the same file.

Times, each side in one process with the weights resident:
  - iris: ONE `iris encode --batch --warmup --repeat R --timings-json FILE` per tower and batch
    size; the JSON's first call (the warm-up: kernel loads, allocator growth) is reported apart,
    and the steady time is the median of the R calls after it: their forward passes alone
    (pixels on the device, outputs left there, as transformers is timed), with the whole call
    (upload and read-back to host f32 too) printed beside it.
  - transformers: the model call between two torch.cuda.synchronize() calls; the first call
    apart, then the median of R calls.

Throughput: the tower's FLOPs (`tower_flops`: GEMMs as 2*m*n*k for the patch embedding, qkv,
proj, MLP and mergers; attention as 4*s^2*hidden per layer and image segment, windowed layers
over their windows) divided by each side's steady time, and its share of the GPU's bf16 peak,
measured here as the median of a few 8192x8192x8192 bf16 torch.matmul (--peak-tflops
overrides it). One 448x448 image is about 1.5 TFLOP through Qwen2-VL-2B, 1.3 through
Qwen2.5-VL-7B and 0.8 through Qwen3-VL-8B (`--flops` prints the breakdown).

A tower transformers cannot build (an older release without its class) is not skipped
silently: its rows say why, iris's side still runs, and the exit status is 1. So is iris slower
than transformers: the goal in docs/PERFORMANCE.md is iris at least as fast.

Usage (called by tools/gpu-check.sh):
    python3 tools/gpu-check/towers_vs_transformers.py --iris target/release/iris --repeats 10
A dry check of iris's side without a GPU or torch (cli/tests/gpu_check.rs runs it):
    python3 tools/gpu-check/towers_vs_transformers.py --iris target/debug/iris --iris-only \\
        --device cpu --towers tiny --image-size 112 --batches 1,2 --repeats 2
"""

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib

# Vision dims of each tower, as the iris preset of the same name has them. `family` picks the
# transformers classes and the FLOP rules; `gated` is Qwen2.5-VL's SwiGLU MLP (three matrices).
TOWERS = {
    "qwen2-vl-2b": dict(family="qwen2_vl", depth=32, hidden=1280, heads=16, intermediate=5120,
                        out_hidden=1536, patch=14, act="quick_gelu"),
    "qwen2.5-vl-7b": dict(family="qwen2_5_vl", depth=32, hidden=1280, heads=16, intermediate=3420,
                          out_hidden=3584, patch=14, act="silu", gated=True, window=112,
                          fullatt=[7, 15, 23, 31]),
    "qwen3-vl-8b": dict(family="qwen3_vl", depth=27, hidden=1152, heads=16, intermediate=4304,
                        out_hidden=4096, patch=16, act="gelu_pytorch_tanh", deepstack=[8, 16, 24],
                        positions=2304),
    # The iris preset for tests and dry runs (not in the default list).
    "tiny": dict(family="qwen2_vl", depth=2, hidden=64, heads=4, intermediate=128, out_hidden=64,
                 patch=14, act="quick_gelu"),
}
DEFAULT_TOWERS = ["qwen2-vl-2b", "qwen2.5-vl-7b", "qwen3-vl-8b"]
MERGE = 2
TEMPORAL = 2
CHANNELS = 3

# transformers classes per family: (module, config class, model class candidates). The model
# class names are tried in order, so that a rename between releases is named, not guessed.
HF = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLVisionConfig", ["Qwen2VisionTransformerPretrainedModel", "Qwen2VLVisionModel"]),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLVisionConfig",
                   ["Qwen2_5_VisionTransformerPretrainedModel", "Qwen2_5_VLVisionModel"]),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLVisionConfig", ["Qwen3VLVisionModel"]),
}

PEAK_N = 8192


def window_lengths(t, grid_h, grid_w):
    """Patches in each attention window of a Qwen2.5-VL windowed layer, for one image."""
    unit = t["window"] // MERGE // t["patch"]  # the window's side in merged tokens
    mh, mw = grid_h // MERGE, grid_w // MERGE

    def sides(n):
        return [unit] * (n // unit) + ([n % unit] if n % unit else [])

    return [h * w * MERGE * MERGE for h in sides(mh) for w in sides(mw)]


def tower_flops(t, grid_h, grid_w):
    """FLOPs of one image through tower `t`, its grid in patches, by component.

    GEMMs count 2*m*n*k; attention 4*s^2*hidden per layer (Q.K^T and P.V over all heads, for a
    segment of s patches); norms, activations, softmax and rotary/position embeddings, each
    well under 1%, are left out."""
    s = grid_h * grid_w
    d, i, out, depth = t["hidden"], t["intermediate"], t["out_hidden"], t["depth"]
    m = MERGE * MERGE
    full = len(t["fullatt"]) if t.get("window") else depth
    windowed = sum(4 * n * n * d for n in window_lengths(t, grid_h, grid_w)) if t.get("window") else 0
    return {
        "patch_embed": 2 * s * (CHANNELS * TEMPORAL * t["patch"] ** 2) * d,
        "qkv": depth * 2 * s * d * 3 * d,
        "proj": depth * 2 * s * d * d,
        "mlp": depth * 2 * s * d * i * (3 if t.get("gated") else 2),
        "attention": full * 4 * s * s * d + (depth - full) * windowed,
        "merger": (1 + len(t.get("deepstack", []))) * 2 * (s // m) * (m * d * m * d + m * d * out),
    }


def grid_of(t, size):
    """The patch grid of a size x size image (size a multiple of patch * merge)."""
    factor = t["patch"] * MERGE
    if size % factor:
        sys.exit(f"--image-size {size} is not a multiple of {factor} ({t['patch']}-pixel patches merged 2x2)")
    return size // t["patch"], size // t["patch"]


def write_png(path, size):
    """A size x size RGB test pattern as PNG, without Pillow (iris's side needs no Python imaging)."""
    rows = b"".join(b"\x00" + bytes(((x * 7 + y * 3) % 256) for x in range(size) for _ in range(3))
                    for y in range(size))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def read_timings(path, images, tokens):
    """The iris side of one case from `iris encode --timings-json`: first call and steady median, ms.

    The forward pass alone is what is compared (`forward_ms`: pixels already on the device,
    outputs left there, as transformers' model call is timed); the whole call, with the upload
    and the read-back to host f32, is kept beside it (`call_median_ms`). Checks that iris encoded
    what the FLOP count assumes (images, tokens)."""
    with open(path) as f:
        t = json.load(f)
    for key in ("images", "tokens", "first_call_ms", "calls_ms", "first_forward_ms", "forward_ms",
                "dtype", "device", "warmup"):
        if key not in t:
            raise ValueError(f"{path} has no `{key}`; is it what `iris encode --timings-json` writes today?")
    if (t["images"], t["tokens"]) != (images, tokens):
        raise ValueError(f"iris encoded {t['images']} images, {t['tokens']} tokens; expected {images}, {tokens}")
    calls, forward = t["calls_ms"], t["forward_ms"]
    for name, values in (("calls_ms", calls + [t["first_call_ms"]]), ("forward_ms", forward + [t["first_forward_ms"]])):
        if len(values) < 2 or not all(isinstance(c, (int, float)) and c > 0 for c in values):
            raise ValueError(f"{path}: {name} {values}")
    if len(forward) != len(calls) or any(f > c for f, c in zip(forward, calls)):
        raise ValueError(f"{path}: forward_ms {forward} do not fit in calls_ms {calls}")
    return {"first_ms": t["first_forward_ms"], "median_ms": statistics.median(forward), "forward_ms": forward,
            "first_call_ms": t["first_call_ms"], "call_median_ms": statistics.median(calls), "calls_ms": calls,
            "warmup": t["warmup"], "dtype": t["dtype"], "device": t["device"]}


def time_iris(args, tower, image, count, tmp):
    timings = os.path.join(tmp, "timings.json")
    cmd = [args.iris, "encode", "--device", args.device, "--model", tower, "--weights", "dummy",
           "--dtype", args.dtype, "--batch", "--warmup", "--repeat", str(args.repeats),
           "--timings-json", timings, "--out", os.path.join(tmp, "out.safetensors")] + [image] * count
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"iris encode exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return timings


def attention_implementation():
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return "sdpa"


def hf_config_params(t):
    common = dict(depth=t["depth"], num_heads=t["heads"], patch_size=t["patch"], spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, hidden_act=t["act"])
    if t["family"] == "qwen2_vl":
        return dict(common, embed_dim=t["hidden"], hidden_size=t["out_hidden"],
                    # transformers 5's config validation takes an int (Qwen2-VL's ratio is 4).
                    mlp_ratio=t["intermediate"] // t["hidden"])
    params = dict(common, hidden_size=t["hidden"], intermediate_size=t["intermediate"], out_hidden_size=t["out_hidden"])
    if t["family"] == "qwen2_5_vl":
        params.update(window_size=t["window"], fullatt_block_indexes=t["fullatt"])
    else:
        params.update(deepstack_visual_indexes=t["deepstack"], num_position_embeddings=t["positions"])
    return params


def build_transformers(t, attention):
    """The tower in transformers, on the GPU in bf16, or the reason it cannot be built."""
    import importlib

    import torch
    import transformers

    module, config_name, model_names = HF[t["family"]]
    where = f"transformers {transformers.__version__}"
    try:
        configs = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
        models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError as err:
        return None, f"{where} has no transformers.models.{module} ({err})"
    if not hasattr(configs, config_name):
        return None, f"{where} has no {config_name}"
    cls = next((getattr(models, n) for n in model_names if hasattr(models, n)), None)
    if cls is None:
        return None, f"{where} has none of {', '.join(model_names)} in transformers.models.{module}"
    config = getattr(configs, config_name)(**hf_config_params(t))
    config._attn_implementation = attention
    torch.manual_seed(0)
    # Initialised on the GPU: random init of a 0.7B tower on the host takes longer than the check.
    with torch.device("cuda"):
        try:
            model = cls._from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers before the `dtype` keyword
            model = cls._from_config(config, torch_dtype=torch.bfloat16)
    return model.to("cuda").eval(), None


def hf_inputs(t, image_path, count, grid):
    import torch
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    kwargs = dict(patch_size=t["patch"], merge_size=MERGE, temporal_patch_size=TEMPORAL)
    if t["family"] == "qwen3_vl":
        kwargs.update(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen2VLImageProcessor(**kwargs)
    image = Image.open(image_path).convert("RGB")
    out = processor(images=[image] * count, return_tensors="pt")
    got = [tuple(int(v) for v in row) for row in out["image_grid_thw"].tolist()]
    if got != [(1, grid[0], grid[1])] * count:
        raise RuntimeError(f"the processor made grids {got[:2]}..., expected (1, {grid[0]}, {grid[1]})")
    return out["pixel_values"].to("cuda", torch.bfloat16), out["image_grid_thw"].to("cuda")


def time_transformers(model, batch, repeats):
    import torch

    pixels, grid = batch

    def once():
        with torch.inference_mode():
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(pixels, grid_thw=grid)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) * 1e3

    first = once()
    calls = [once() for _ in range(repeats)]
    return {"first_ms": first, "median_ms": statistics.median(calls), "calls_ms": calls}


def measure_peak(samples=10):
    """bf16 dense TFLOPS of this GPU: the median of `samples` 8192^3 matmuls after a warm-up."""
    import torch

    a = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * PEAK_N**3 / statistics.median(times) / 1e12


def throughput(side, flop, images, peak):
    side["ms_per_image"] = side["median_ms"] / images
    side["tflops"] = flop / (side["median_ms"] / 1e3) / 1e12
    side["share_of_peak"] = side["tflops"] / peak if peak else None


def print_flops(towers, size, as_json):
    table = {}
    for name in towers:
        t = TOWERS[name]
        parts = tower_flops(t, *grid_of(t, size))
        table[name] = dict(parts, total=sum(parts.values()))
        print(f"{name}, one {size}x{size} image: {table[name]['total'] / 1e12:.3f} TFLOP ("
              + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items()) + " GFLOP)")
    if as_json:
        with open(as_json, "w") as f:
            json.dump({"image_size": size, "flop_per_image": table}, f, indent=2)


def fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iris", default="target/release/iris")
    parser.add_argument("--device", default="cuda", help="iris's --device (cpu for a dry run with --iris-only)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--towers", default=",".join(DEFAULT_TOWERS), help=f"comma-separated, of {', '.join(TOWERS)}")
    parser.add_argument("--batches", default="1,4,32", help="images per call, comma-separated")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per case after the first")
    parser.add_argument("--iris-only", action="store_true", help="time iris alone: no torch, no transformers")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's bf16 peak instead of measuring it")
    parser.add_argument("--flops", action="store_true", help="print each tower's FLOPs per image and exit")
    parser.add_argument("--measure-peak", action="store_true",
                        help="print the GPU's measured bf16 peak in TFLOPS (for iris bench --peak-tflops) and exit")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    towers = [t for t in args.towers.split(",") if t]
    unknown = [t for t in towers if t not in TOWERS]
    if unknown:
        parser.error(f"unknown tower(s) {', '.join(unknown)}; known: {', '.join(TOWERS)}")
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.repeats < 1 or not batches or min(batches) < 1:
        parser.error("--repeats and every batch size must be at least 1")
    if args.flops:
        print_flops(towers, args.image_size, args.json)
        return 0
    if args.measure_peak:
        print(f"{measure_peak():.1f}")
        return 0

    results = {"device": args.device, "dtype": args.dtype, "image_size": args.image_size, "repeats": args.repeats,
               "gpu": None, "attention": None, "peak_tflops": args.peak_tflops,
               "peak_source": "--peak-tflops" if args.peak_tflops else None, "rows": [], "not_compared": []}
    if not args.iris_only:
        import torch
        import transformers

        results["gpu"] = torch.cuda.get_device_name(0)
        results["attention"] = attention_implementation()
        results["transformers"] = transformers.__version__
        if args.peak_tflops is None:
            results["peak_tflops"] = measure_peak()
            results["peak_source"] = f"measured: {PEAK_N}^3 bf16 torch.matmul, median of 10"
        print(f"GPU {results['gpu']}: bf16 peak {results['peak_tflops']:.0f} TFLOPS ({results['peak_source']}); "
              f"transformers {transformers.__version__} with {results['attention']}", flush=True)
    peak = results["peak_tflops"]

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        image = os.path.join(tmp, "image.png")
        write_png(image, args.image_size)
        for name in towers:
            t = TOWERS[name]
            grid = grid_of(t, args.image_size)
            flop_image = sum(tower_flops(t, *grid).values())
            tokens_image = grid[0] * grid[1] // (MERGE * MERGE)
            model, why = None, None
            if not args.iris_only:
                try:
                    model, why = build_transformers(t, results["attention"])
                except Exception as err:  # whatever a release raises, it is reported, not skipped
                    why = f"building it failed: {err!r}"
            if why:
                print(f"{name}: transformers side not run: {why}", flush=True)
                results["not_compared"].append({"tower": name, "reason": why})
                failed = True
            for count in batches:
                row = {"tower": name, "images": count, "tokens": tokens_image * count,
                       "tflop": flop_image * count / 1e12, "iris": None, "transformers": None}
                try:
                    row["iris"] = read_timings(time_iris(args, name, image, count, tmp), count, row["tokens"])
                    throughput(row["iris"], flop_image * count, count, peak)
                except (RuntimeError, ValueError, OSError) as err:
                    row["iris_error"] = str(err)
                    print(f"{name}, {count} image(s): iris failed: {err}", flush=True)
                    failed = True
                if model is not None:
                    try:
                        row["transformers"] = time_transformers(model, hf_inputs(t, image, count, grid), args.repeats)
                        throughput(row["transformers"], flop_image * count, count, peak)
                    except Exception as err:  # whatever a release raises, it is reported, not skipped
                        row["transformers_error"] = repr(err)
                        print(f"{name}, {count} image(s): transformers failed: {err}", flush=True)
                        failed = True
                elif why:
                    row["transformers_error"] = why
                hf, ours = row["transformers"], row["iris"]
                if hf and ours:
                    row["speedup"] = hf["median_ms"] / ours["median_ms"]
                    failed |= row["speedup"] < 1
                results["rows"].append(row)
                print(f"{name}, {count} image(s): "
                      + (f"transformers {hf['median_ms']:.2f} ms, " if hf else "")
                      + (f"iris first forward {ours['first_ms']:.1f} ms, steady {ours['median_ms']:.2f} ms "
                         f"({ours['call_median_ms']:.2f} ms with upload and read-back)" if ours else "iris -")
                      + (f", iris is {row['speedup']:.2f}x transformers' speed" if "speedup" in row else ""), flush=True)
            if model is not None:
                import torch

                del model
                torch.cuda.empty_cache()

    print(f"\n{results['gpu'] or args.device}; dtype {args.dtype}; {args.image_size}x{args.image_size} images; "
          f"median of {args.repeats} calls after the first; bf16 peak {fmt(peak, '.0f')} TFLOPS")
    print("| tower | images | TFLOP | transformers ms/image | iris first forward ms | iris ms/image "
          "| iris ms/image with upload and read-back | transformers / iris "
          "| transformers TFLOPS | share of peak | iris TFLOPS | share of peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        hf, ours = r["transformers"] or {}, r["iris"] or {}
        call = ours["call_median_ms"] / r["images"] if ours else None
        print(f"| {r['tower']} | {r['images']} | {r['tflop']:.3g} | {fmt(hf.get('ms_per_image'), '.2f')} "
              f"| {fmt(ours.get('first_ms'), '.1f')} | {fmt(ours.get('ms_per_image'), '.2f')} | {fmt(call, '.2f')} "
              f"| {fmt(r.get('speedup'), '.2f')} "
              f"| {fmt(hf.get('tflops'), '.3g')} | {fmt(hf.get('share_of_peak'), '.1%')} "
              f"| {fmt(ours.get('tflops'), '.3g')} | {fmt(ours.get('share_of_peak'), '.1%')} |")
    for n in results["not_compared"]:
        print(f"not compared with transformers: {n['tower']}: {n['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
