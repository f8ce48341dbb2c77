#!/usr/bin/env python3
"""Qwen2-VL-2B vision tower, f32 or bf16, dummy weights: iris (CPU device) vs transformers on torch.

Both run in this one script, alternating, with the same thread count and the same image:
one 448x448 image (1024 patches, 256 tokens) and a batch of four. For each case the script
reports the median time over the repeats, the ratio, and the GFLOP/s each reaches against the
machine's GEMM peak in the same dtype measured in the same run (torch's 2048^3 matmul). It
prints the CPU model and its matrix features, and the kernel tier iris's CPU device runs.

iris's time is what `iris encode` prints per call (upload, tower, read-back; weights already
resident, after one untimed warm-up call: `iris encode --warmup`), torch's is the model call
under `torch.inference_mode()`, also after a warm-up call. Weight creation is not timed on either
side.

Usage (from the repository root, with the virtual environment of tools/golden/README.md):
    cargo build --release -p iris
    /work/venv/bin/python tools/bench/tower_vs_torch.py --threads 2 --repeats 5 --dtype bf16
    /work/venv/bin/python tools/bench/tower_vs_torch.py --threads 2 --repeats 5 --dtype f32

`--isa` forces the instruction set on both sides: iris's kernel tier (IRIS_CPU_ISA: amx,
avx512bf16, avx512, avx2, generic) and torch's, through ATEN_CPU_CAPABILITY (ATen's own kernels,
SDPA among them), MKL_ENABLE_INSTRUCTIONS (MKL's SGEMM, which f32 linear layers call) and
ONEDNN_MAX_CPU_ISA (oneDNN, e.g. the patch embedding's convolution). The variables are set before
torch is imported; the header prints the capability torch then reports. `--isa avx2` on an
AVX-512 machine measures both sides as an AVX2-only machine would run them (same cores, caches
and clock, so not the same as a real AVX2 machine).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

PATCH = 14
MERGE = 2
DEPTH = 32
WIDTH = 1280
MLP = 5120
OUT = 1536
HEADS = 16


def tower_flops(patches_per_image, images):
    """Flop count of the reference (shared/reference/cpu-performance.md)."""
    n_total = patches_per_image * images
    patch_embed = 2 * 3 * 2 * PATCH * PATCH * WIDTH * n_total
    per_token_layer = 2 * (4 * WIDTH * WIDTH + 2 * WIDTH * MLP)
    blocks = DEPTH * per_token_layer * n_total
    attention = DEPTH * images * 4 * patches_per_image**2 * WIDTH
    merged = n_total // (MERGE * MERGE)
    wide = WIDTH * MERGE * MERGE
    merger = 2 * merged * (wide * wide + wide * OUT)
    return patch_embed + blocks + attention + merger


def make_image(path):
    from PIL import Image
    import numpy as np

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:448, 0:448]
    base = np.stack([x % 256, y % 256, (x + y) % 256], axis=-1).astype(np.float32)
    noise = rng.normal(0, 12, size=base.shape)
    Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8)).save(path)


# Torch's variables per iris tier: ATen capability, MKL instructions, oneDNN's ISA cap. Tiers
# above avx512 leave torch at its own choice (it has no separate bf16 instruction-set switch).
TORCH_ISA = {
    "generic": ("default", "SSE4_2", "SSE41"),
    "avx2": ("avx2", "AVX2", "AVX2"),
    "avx512": ("avx512", "AVX512", "AVX512_CORE"),
    "widened": ("avx512", "AVX512", "AVX512_CORE"),
}


def force_torch_isa(isa):
    """Sets torch's instruction-set variables for `isa` (before torch is imported)."""
    if "torch" in sys.modules:
        sys.exit("torch's instruction set must be set before torch is imported")
    values = TORCH_ISA.get(isa.lower())
    if values is None:
        return {}
    env = dict(zip(["ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"], values))
    os.environ.update(env)
    return env


def torch_capability():
    import torch

    return torch.backends.cpu.get_cpu_capability()


def torch_dtype(dtype):
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]


def cpu_summary():
    """CPU model and the features that decide the matrix kernels, from /proc/cpuinfo."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]
    return model, [flag for flag in wanted if flag in flags]


def iris_kernel_tier(iris, config, isa):
    env = {**os.environ, "IRIS_DEVICE": "cpu"}
    if isa:
        env["IRIS_CPU_ISA"] = isa
    result = subprocess.run([iris, "--config", config, "devices"], capture_output=True, text=True, env=env)
    match = re.search(r"kernel_tier\W+(\w+)", result.stdout)
    return match.group(1) if match else "unknown"


def torch_setup(threads, dtype):
    import torch
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen2VLVisionConfig(
        depth=DEPTH,
        embed_dim=WIDTH,
        hidden_size=OUT,
        num_heads=HEADS,
        mlp_ratio=MLP // WIDTH,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
    )
    config._attn_implementation = "sdpa"
    model = Qwen2VisionTransformerPretrainedModel._from_config(config, dtype=torch_dtype(dtype))
    model.eval()
    return model


def torch_inputs(image_path, count, dtype):
    import torch
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor()
    image = Image.open(image_path).convert("RGB")
    out = processor(images=[image] * count, return_tensors="pt")
    return out["pixel_values"].to(torch_dtype(dtype)), out["image_grid_thw"]


def time_torch(model, inputs):
    import torch

    pixels, grid = inputs
    with torch.inference_mode():
        start = time.perf_counter()
        model(pixels, grid_thw=grid)
        return time.perf_counter() - start


def gemm_peak(threads, repeats, dtype):
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(2048, 2048, dtype=torch_dtype(dtype))
    b = torch.randn(2048, 2048, dtype=torch_dtype(dtype))
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * 2048**3 / statistics.median(times) / 1e9


def time_iris(iris, config, image_path, count, out_dir, dtype, isa, warmup=False):
    args = [iris, "--config", config, "encode", "--model", "qwen2-vl-2b", "--weights", "dummy"]
    args += ["--dtype", dtype, "--out", os.path.join(out_dir, "out.safetensors")]
    if warmup:
        # One untimed call first, as torch gets: one-time work at first use (packing constant
        # weights for the bf16 kernels) is not what a serving engine pays per request.
        args.append("--warmup")
    if count > 1:
        args.append("--batch")
    args += [image_path] * count
    env = {**os.environ, "IRIS_DEVICE": "cpu"}
    if isa:
        env["IRIS_CPU_ISA"] = isa
    result = subprocess.run(args, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"iris failed:\n{result.stdout}\n{result.stderr}")
    match = re.search(r"(?:batch of \d+ in )?([0-9.]+) s\s*$", result.stdout.strip().splitlines()[-2])
    if not match:
        sys.exit(f"cannot read iris's time from:\n{result.stdout}")
    return float(match.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iris", default="target/release/iris")
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                        help="the model's dtype on both sides (default f32)")
    parser.add_argument("--isa", help="force the instruction set of both sides: iris's kernel tier "
                        "(IRIS_CPU_ISA) and torch's (see above)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    torch_env = force_torch_isa(args.isa) if args.isa else {}

    with tempfile.TemporaryDirectory() as tmp:
        image = os.path.join(tmp, "image.png")
        make_image(image)
        config = os.path.join(tmp, "iris.toml")
        with open(config, "w") as f:
            f.write(f'device = "cpu"\n[plugins.cpu]\nthreads = {args.threads}\n')
        model_name, features = cpu_summary()
        tier = iris_kernel_tier(args.iris, config, args.isa)
        capability = torch_capability()
        print(f"CPU: {model_name}; features: {' '.join(features) or 'none of note'}; "
              f"iris kernel tier: {tier}; torch CPU capability: {capability} "
              f"({' '.join(f'{k}={v}' for k, v in torch_env.items()) or 'its own choice'}); "
              f"dtype: {args.dtype}", flush=True)
        model = torch_setup(args.threads, args.dtype)
        cases = {1: torch_inputs(image, 1, args.dtype), 4: torch_inputs(image, 4, args.dtype)}
        time_torch(model, cases[1])  # warm-up
        results = {count: {"iris": [], "torch": []} for count in cases}
        for repeat in range(args.repeats):
            for count, inputs in cases.items():
                results[count]["torch"].append(time_torch(model, inputs))
                results[count]["iris"].append(
                    time_iris(args.iris, config, image, count, tmp, args.dtype, args.isa, warmup=True))
                print(f"repeat {repeat + 1}/{args.repeats}, {count} image(s): "
                      f"torch {results[count]['torch'][-1]:.2f} s, iris {results[count]['iris'][-1]:.2f} s",
                      flush=True)
        peak = gemm_peak(args.threads, args.repeats, args.dtype)

    patches = (448 // PATCH) ** 2
    summary = {"threads": args.threads, "repeats": args.repeats, "dtype": args.dtype, "cpu": model_name,
               "cpu_features": features, "kernel_tier": tier,
               "torch_capability": capability, "torch_env": torch_env, "gemm_peak_gflops": peak, "cases": {}}
    print(f"\nCPU: {model_name}; features: {' '.join(features)}; iris kernel tier: {tier}; "
          f"torch CPU capability: {capability}")
    print(f"{args.dtype} GEMM peak (torch 2048^3 matmul, {args.threads} threads): {peak:.0f} GFLOP/s")
    print("| images | torch median s | iris median s | torch / iris | torch GFLOP/s (% peak) | iris GFLOP/s (% peak) |")
    print("|---|---|---|---|---|---|")
    for count, times in results.items():
        flops = tower_flops(patches, count)
        t_torch = statistics.median(times["torch"])
        t_iris = statistics.median(times["iris"])
        g_torch = flops / t_torch / 1e9
        g_iris = flops / t_iris / 1e9
        summary["cases"][count] = {"torch_s": t_torch, "iris_s": t_iris, "ratio": t_torch / t_iris,
                                   "torch_gflops": g_torch, "iris_gflops": g_iris, "flops": flops}
        print(f"| {count} | {t_torch:.2f} | {t_iris:.2f} | {t_torch / t_iris:.2f} | "
              f"{g_torch:.0f} ({100 * g_torch / peak:.0f}%) | {g_iris:.0f} ({100 * g_iris / peak:.0f}%) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
