#!/usr/bin/env python3
"""Where a vision tower's time should go on a GPU, kernel by kernel, and where it went.

The model lists every kernel the CUDA device launches for one forward pass of a tower over a
batch of equal images (the ops of core/src/encoder/tower.rs as device-cuda runs them: cuBLASLt
products with the bias fused, an f32 product plus `gemm_epilogue` where an activation follows,
`norm`, `rotary`, `flash_attention`, `binary`, `gather` and the per-image copies), each with its
FLOPs and the bytes it moves in bf16, and times each as

    max(FLOPs / rate, bytes / (bandwidth * memory efficiency)) + launch gap

with rate the GEMM share of the measured bf16 peak for products and the attention rate for
attention. The sum, per image, is what the kernels need with no host time between steps; the
goal of the GPU-tower work is 50% of the peak at the serving step (FLOPs per image over half the
peak). The defaults are an H200: the bf16 peak an 8192^3 torch.matmul reached there (790
TFLOPS), HBM3e's 4.8 TB/s, cuBLASLt at 75% of that peak on these shapes, iris's tensor-core
attention at the 163 to 184 TFLOPS it measured at 4096 tokens (shorter segments run slower), and
4 us between dependent launches. Every figure is a flag.

With `--ncu CSV` (Nsight Compute's `--csv --metrics gpu__time_duration.sum` output for the same
pass, as tools/gpu-check.sh's `kernels` step writes it) the measured kernel times are summed by
the same categories and printed beside the model. Where the CSV also has `dram__bytes.sum` and
`sm__throughput.avg.pct_of_peak_sustained_elapsed` (the step asks for both), each category also
gets the bytes it moved to and from device memory, their rate, and its SMs' busiest unit as a
share of peak, weighted by time: a category near the bandwidth with idle SMs is memory-bound, one
with busy SMs and little traffic is bound by its instructions.

Usage:
    python3 tools/gpu-check/kernel_model.py --towers qwen3-vl-8b --image-size 448
    python3 tools/gpu-check/kernel_model.py --towers qwen3-vl-8b --ncu kernels-qwen3-vl-8b.csv
Plain Python, no packages.
"""

import argparse
import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from towers_vs_transformers import (  # noqa: E402  (the tower table lives there)
    CHANNELS, DEFAULT_TOWERS, MERGE, TEMPORAL, TOWERS, grid_of, tower_flops, window_lengths)

BF16 = 2
F32 = 4
# Categories, in the order printed. A kernel name (ncu) falls in the first whose test matches.
CATEGORIES = ["gemm", "gemm_epilogue", "attention", "norm", "rotary", "elementwise", "gather",
              "copy", "other"]


def category_of(kernel_name):
    """The category of a kernel Nsight Compute names (iris's kernels by their prefix, cuDNN's fused
    attention by its name; the rest of a forward pass is cuBLAS(Lt)'s and the driver's copies)."""
    name = kernel_name.split("(")[0].strip().lower()
    for prefix, category in (("gemm_epilogue", "gemm_epilogue"), ("flash_attention", "attention"),
                             ("attention", "attention"), ("norm", "norm"), ("rotary", "rotary"),
                             ("binary", "elementwise"), ("activation", "elementwise"),
                             ("cast", "elementwise"), ("gather", "gather"), ("copy", "copy")):
        if name.startswith(prefix):
            return category
    # cuDNN's fused attention (`cudnn_generated_fort_native_sdpa_sm90_...`): before the GEMM
    # words, which its names contain too.
    if any(word in name for word in ("sdpa", "fmha", "flash_fprop")):
        return "attention"
    if any(word in name for word in ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "ampere_",
                                     "splitk", "cublas")):
        return "gemm"
    return "other"


def kernels(t, images, grid_h, grid_w):
    """The kernels of one forward pass over `images` images of grid_h x grid_w patches: a list of
    (name, category, count, flops, bytes), counts and totals for the whole pass."""
    d, inner, out, depth = t["hidden"], t["intermediate"], t["out_hidden"], t["depth"]
    heads = t["heads"]
    head_dim = d // heads
    rows = images * grid_h * grid_w
    unit = MERGE * MERGE
    merged = rows // unit
    patch_len = CHANNELS * TEMPORAL * t["patch"] ** 2
    ks = []

    def gemm(name, m, n, k, activation=False, accumulate=False, count=1):
        flops = 2 * m * n * k
        traffic = (m * k + n * k + m * n) * BF16 + (m * n * BF16 if accumulate else 0)
        if activation:
            # The product goes to f32 scratch; the epilogue reads it and writes bf16.
            traffic += m * n * (F32 - BF16)
            ks.append((name, "gemm", count, flops * count, traffic * count))
            ks.append((name + " epilogue", "gemm_epilogue", count, 0, m * n * (F32 + BF16) * count))
        else:
            ks.append((name, "gemm", count, flops * count, traffic * count))

    def pass_over(name, category, m, width, reads=1, writes=1, count=1, dtype=BF16):
        ks.append((name, category, count, 0, m * width * dtype * (reads + writes) * count))

    gemm("patch_embed", rows, d, patch_len)
    if t.get("positions"):
        pass_over("position embeddings gather", "gather", rows, d)
        pass_over("position embeddings add", "elementwise", rows, d, reads=2)
    if t.get("window"):
        pass_over("window order gather", "gather", rows, d)
    pass_over("rotary tables gather", "gather", rows, head_dim, count=2, dtype=F32)

    full = len(t["fullatt"]) if t.get("window") else depth
    segment_sq = images * (grid_h * grid_w) ** 2
    windowed_sq = images * sum(n * n for n in window_lengths(t, grid_h, grid_w)) if t.get("window") else 0
    norm_count = 2 * depth
    pass_over("norm1, norm2", "norm", rows, d, count=norm_count)
    gemm("qkv", rows, 3 * d, d, count=depth)
    pass_over("rotary (q and k)", "rotary", rows, 2 * d, count=depth)
    attention_flops = 4 * d * (full * segment_sq + (depth - full) * windowed_sq)
    ks.append(("attention", "attention", depth, attention_flops, depth * rows * 4 * d * BF16))
    gemm("proj (+= hidden)", rows, d, d, accumulate=True, count=depth)
    if t.get("gated"):
        gemm("mlp gate (act)", rows, inner, d, activation=True, count=depth)
        gemm("mlp up", rows, inner, d, count=depth)
        pass_over("gate * up", "elementwise", rows, inner, reads=2, count=depth)
        gemm("mlp down (+= hidden)", rows, d, inner, accumulate=True, count=depth)
    else:
        gemm("mlp fc1 (act)", rows, inner, d, activation=True, count=depth)
        gemm("mlp fc2 (+= hidden)", rows, d, inner, accumulate=True, count=depth)

    mergers = 1 + len(t.get("deepstack", []))
    pass_over("merger norm", "norm", rows, d, count=mergers)
    gemm("merger fc1 (gelu)", merged, unit * d, unit * d, activation=True, count=mergers)
    gemm("merger fc2", merged, out, unit * d, count=mergers)
    # Each image's rows of every output into a buffer of its own (gathers in window order for
    # Qwen2.5-VL).
    per_image = merged // images
    split = "gather" if t.get("window") else "copy"
    pass_over("outputs per image", split, per_image, out, count=images * mergers)
    return ks


def model(ks, peak, bandwidth, gemm_share, attention_tflops, memory_share, launch_us):
    """Modelled seconds of each kernel row: (row, seconds)."""
    timed = []
    for name, category, count, flops, traffic in ks:
        rate = attention_tflops * 1e12 if category == "attention" else peak * 1e12 * gemm_share
        compute = flops / rate if flops else 0.0
        memory = traffic / (bandwidth * 1e12 * memory_share)
        timed.append(((name, category, count, flops, traffic), max(compute, memory) + count * launch_us * 1e-6))
    return timed


def read_ncu(path):
    """Measured seconds, launches, DRAM bytes and time-weighted SM throughput (%) per category
    from Nsight Compute's CSV (one row per kernel and metric; the `ID`, `Kernel Name`, `Metric
    Name`, `Metric Unit` and `Metric Value` columns; times in ns, us, ms or s, bytes in byte,
    Kbyte, Mbyte or Gbyte; `--print-units base` gives ns and bytes). Bytes and throughput are
    None for a category whose kernels the CSV gives no such rows for."""
    time_scale = {"ns": 1e-9, "nsecond": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3,
                  "ms": 1e-3, "second": 1.0, "s": 1.0}
    byte_scale = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "b": 1.0}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own log lines are not quoted
    reader = csv.DictReader(lines)
    kernels = {}  # ID -> {"category", "seconds", "bytes", "sm_pct"}
    for row in reader:
        metric = row.get("Metric Name")
        if metric not in ("gpu__time_duration.sum", "dram__bytes.sum",
                          "sm__throughput.avg.pct_of_peak_sustained_elapsed"):
            continue
        unit = row.get("Metric Unit", "").strip().lower()
        value = float(row["Metric Value"].replace(",", ""))
        kernel = kernels.setdefault(row.get("ID", str(len(kernels))),
                                    {"category": category_of(row["Kernel Name"])})
        if metric == "gpu__time_duration.sum":
            if unit not in time_scale:
                raise ValueError(f"{path}: unknown time unit {unit!r}")
            kernel["seconds"] = value * time_scale[unit]
        elif metric == "dram__bytes.sum":
            if unit not in byte_scale:
                raise ValueError(f"{path}: unknown byte unit {unit!r}")
            kernel["bytes"] = value * byte_scale[unit]
        else:
            kernel["sm_pct"] = value
    timed = [k for k in kernels.values() if "seconds" in k]
    if not timed:
        raise ValueError(f"{path} has no gpu__time_duration.sum rows: is it ncu --csv output?")
    measured = {c: {"seconds": 0.0, "launches": 0, "bytes": None, "sm_pct": None} for c in CATEGORIES}
    weighted = {c: [0.0, 0.0] for c in CATEGORIES}  # sum of pct * seconds, seconds with a pct
    for kernel in timed:
        entry = measured[kernel["category"]]
        entry["seconds"] += kernel["seconds"]
        entry["launches"] += 1
        if "bytes" in kernel:
            entry["bytes"] = (entry["bytes"] or 0.0) + kernel["bytes"]
        if "sm_pct" in kernel:
            weighted[kernel["category"]][0] += kernel["sm_pct"] * kernel["seconds"]
            weighted[kernel["category"]][1] += kernel["seconds"]
    for category, (pct_seconds, seconds) in weighted.items():
        if seconds > 0:
            measured[category]["sm_pct"] = pct_seconds / seconds
    return measured


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", default=",".join(DEFAULT_TOWERS))
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--images", type=int,
                        help="images in the pass (default: as many as an 8192-token step holds)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 peak (H200, torch 8192^3)")
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8, help="device memory bandwidth, TB/s")
    parser.add_argument("--gemm-share", type=float, default=0.75, help="cuBLASLt's share of the peak")
    parser.add_argument("--attention-tflops", type=float, default=165.0)
    parser.add_argument("--memory-share", type=float, default=0.8, help="share of the bandwidth reached")
    parser.add_argument("--launch-us", type=float, default=4.0, help="gap per dependent launch, us")
    parser.add_argument("--ncu", help="Nsight Compute CSV of the same pass (one tower only)")
    parser.add_argument("--json", help="write the model (and measurement) here")
    args = parser.parse_args()

    towers = [name.strip() for name in args.towers.split(",") if name.strip()]
    unknown = [name for name in towers if name not in TOWERS]
    if unknown:
        sys.exit(f"unknown tower {unknown[0]!r}; known: {', '.join(TOWERS)}")
    if args.ncu and len(towers) != 1:
        sys.exit("--ncu measures one tower's pass: give one tower in --towers")
    results = []
    for name in towers:
        t = TOWERS[name]
        grid_h, grid_w = grid_of(t, args.image_size)
        tokens = grid_h * grid_w // (MERGE * MERGE)
        images = args.images or max(1, 8192 // tokens)
        ks = kernels(t, images, grid_h, grid_w)
        timed = model(ks, args.peak_tflops, args.bandwidth_tbs, args.gemm_share,
                      args.attention_tflops, args.memory_share, args.launch_us)
        flops_image = sum(tower_flops(t, grid_h, grid_w).values())
        by_category = {c: {"launches": 0, "gflop": 0.0, "gb": 0.0, "model_ms": 0.0} for c in CATEGORIES}
        for (_, category, count, flops, traffic), seconds in timed:
            entry = by_category[category]
            entry["launches"] += count
            entry["gflop"] += flops / 1e9
            entry["gb"] += traffic / 1e9
            entry["model_ms"] += seconds * 1e3
        total_ms = sum(seconds for _, seconds in timed) * 1e3
        goal_ms = flops_image / (0.5 * args.peak_tflops * 1e12) * 1e3
        result = {"tower": name, "images": images, "image_size": args.image_size,
                  "flop_per_image": flops_image, "model_ms_per_image": total_ms / images,
                  "goal_ms_per_image": goal_ms,
                  "model_share_of_peak": flops_image * images / (total_ms / 1e3) / (args.peak_tflops * 1e12),
                  "categories": by_category,
                  "kernels": [{"name": k[0], "category": k[1], "launches": k[2], "gflop": k[3] / 1e9,
                               "gb": k[4] / 1e9, "model_ms": s * 1e3} for k, s in timed]}
        print(f"\n{name}: {images} images of {args.image_size}x{args.image_size} ({images * tokens} tokens), "
              f"{flops_image / 1e12:.3f} TFLOP an image; model {total_ms / images:.2f} ms an image "
              f"({result['model_share_of_peak']:.0%} of {args.peak_tflops:.0f} TFLOPS), "
              f"serving-step goal (50% of peak) {goal_ms:.2f} ms")
        try:
            measured = read_ncu(args.ncu) if args.ncu else None
        except (OSError, ValueError, KeyError) as err:
            sys.exit(f"kernel_model.py: {err}")
        header = "| category | launches | GFLOP | GB | model ms/image |"
        rule = "|---|---|---|---|---|"
        if measured:
            header += " ncu launches | ncu ms/image | ncu DRAM GB | ncu TB/s | ncu SM busy |"
            rule += "---|---|---|---|---|"
        print(header)
        print(rule)
        for category in CATEGORIES:
            entry = by_category[category]
            line = (f"| {category} | {entry['launches']} | {entry['gflop']:.0f} | {entry['gb']:.2f} "
                    f"| {entry['model_ms'] / images:.3f} |")
            if measured:
                m = measured[category]
                seconds, dram = m["seconds"], m["bytes"]
                rate = f"{dram / seconds / 1e12:.2f}" if dram is not None and seconds > 0 else "-"
                busy = f"{m['sm_pct']:.0f}%" if m["sm_pct"] is not None else "-"
                gb = f"{dram / 1e9:.2f}" if dram is not None else "-"
                line += f" {m['launches']} | {seconds * 1e3 / images:.3f} | {gb} | {rate} | {busy} |"
            if entry["launches"] or (measured and measured[category]["launches"]):
                print(line)
        if measured:
            kernel_s = sum(m["seconds"] for m in measured.values())
            print(f"kernels measured: {kernel_s * 1e3 / images:.2f} ms an image against the model's "
                  f"{total_ms / images:.2f} (launch gaps and host time are not in ncu's sum)")
            result["ncu"] = measured
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
