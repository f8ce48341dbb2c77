#!/usr/bin/env python3
"""The Qwen2-VL-2B tower's heavy f32 ops, one by one: iris's CPU device vs torch, side by side.

iris's side is the `tower_ops` bench of iris-device-cpu (its qkv, proj and fc2 products with bias
and the residual add, fc1 with bias and quick-GELU, and attention over one 448x448 image's 1024
patches, 16 heads of 80), torch's the same ops as transformers runs them: `F.linear` with bias,
the residual added after, `quick_gelu` after fc1, and `F.scaled_dot_product_attention`. Both sides
alternate for `--repeats` rounds; each round's figure is a median of `--inner` calls after
untimed ones (one for iris, three for torch, whose first MKL calls on new operands are slow), and
the table shows the median of the rounds. The bench also measures the tier's fused multiply-add
rate on the same threads, and each GFLOP/s figure is given with its share of that roof.

`--isa` forces the instruction set of both sides as in tower_vs_torch.py (e.g. `--isa avx2`).

Usage (from the repository root):
    cargo bench -p iris-device-cpu --bench tower_ops --no-run   # prints the bench binary's path
    ~/venv-vllm/bin/python tools/bench/ops_vs_torch.py --bench target/release/deps/tower_ops-HASH \
        --threads 2 --repeats 3 --isa avx2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tower_vs_torch import force_torch_isa, torch_capability  # noqa: E402

TOKENS, WIDTH, MLP, HEADS, HEAD_DIM = 1024, 1280, 5120, 16, 80
# Untimed torch calls per op before the timed ones.
WARMUP_CALLS = 3
# Seconds the torch process idles before the iris bench starts.
IDLE_BEFORE_IRIS_S = 2.0


def torch_ops(threads):
    """Each op as a closure over its inputs, with its flop count (as the iris bench counts)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH)
    h = torch.randn(TOKENS, MLP)
    res = torch.randn(TOKENS, WIDTH)
    w_qkv, b_qkv = torch.randn(3 * WIDTH, WIDTH) / 40, torch.randn(3 * WIDTH)
    w_proj, b_proj = torch.randn(WIDTH, WIDTH) / 40, torch.randn(WIDTH)
    w_fc1, b_fc1 = torch.randn(MLP, WIDTH) / 40, torch.randn(MLP)
    w_fc2, b_fc2 = torch.randn(WIDTH, MLP) / 80, torch.randn(WIDTH)
    q, k, v = (torch.randn(1, HEADS, TOKENS, HEAD_DIM) for _ in range(3))

    def quick_gelu(t):
        return t * torch.sigmoid(1.702 * t)

    return {
        "qkv": (lambda: F.linear(x, w_qkv, b_qkv), 2 * TOKENS * WIDTH * 3 * WIDTH),
        "proj_residual": (lambda: res + F.linear(x, w_proj, b_proj), 2 * TOKENS * WIDTH * WIDTH),
        "fc1_quick_gelu": (lambda: quick_gelu(F.linear(x, w_fc1, b_fc1)), 2 * TOKENS * WIDTH * MLP),
        "fc2_residual": (lambda: res + F.linear(h, w_fc2, b_fc2), 2 * TOKENS * MLP * WIDTH),
        "attention": (lambda: F.scaled_dot_product_attention(q, k, v), 4 * TOKENS * TOKENS * WIDTH),
    }


def time_torch(op, inner):
    import torch

    with torch.inference_mode():
        # MKL's first calls on new operands run well below its steady rate.
        for _ in range(WARMUP_CALLS):
            op()
        times = []
        for _ in range(inner):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_iris(bench, threads, inner, isa):
    # torch's OpenMP threads spin for a while after its last op; let them go to sleep first, or
    # they take cycles from the bench.
    time.sleep(IDLE_BEFORE_IRIS_S)
    env = {**os.environ, "IRIS_BENCH_THREADS": str(threads), "IRIS_BENCH_REPEATS": str(inner)}
    if isa:
        env["IRIS_CPU_ISA"] = isa
    result = subprocess.run([bench], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"the iris bench failed:\n{result.stdout}\n{result.stderr}")
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {row["op"]: row for row in rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", required=True, help="the tower_ops bench binary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (the table shows their median)")
    parser.add_argument("--inner", type=int, default=5, help="calls per op per round (median)")
    parser.add_argument("--isa", help="force the instruction set of both sides (see tower_vs_torch.py)")
    args = parser.parse_args()
    torch_env = force_torch_isa(args.isa) if args.isa else {}

    ops = torch_ops(args.threads)
    results = {name: {"iris": [], "torch": []} for name in ops}
    tier = "unknown"
    peaks = []
    for repeat in range(args.repeats):
        iris = run_iris(args.bench, args.threads, args.inner, args.isa)
        if "fma_peak" in iris:
            peaks.append(iris["fma_peak"]["gflops"])
        for name, (op, _) in ops.items():
            results[name]["torch"].append(time_torch(op, args.inner))
            results[name]["iris"].append(iris[name]["seconds"])
            tier = iris[name]["tier"]
        print(f"round {repeat + 1}/{args.repeats} done", flush=True)

    print(f"\niris kernel tier: {tier}; torch CPU capability: {torch_capability()} "
          f"({' '.join(f'{k}={v}' for k, v in torch_env.items()) or 'its own choice'}); "
          f"{args.threads} threads")
    # The roof: the tier's fused multiply-add rate on the same threads (the bench's first line).
    peak = statistics.median(peaks) if peaks else None
    if peak:
        print(f"FMA peak of the tier on {args.threads} threads: {peak:.0f} GFLOP/s "
              f"(rounds: {' / '.join(f'{p:.0f}' for p in peaks)}); (%) is the share of it")
    print("| op | torch ms | iris ms | torch / iris | torch GFLOP/s | iris GFLOP/s |")
    print("|---|---|---|---|---|---|")

    def rate(flops, seconds):
        gflops = flops / seconds / 1e9
        return f"{gflops:.0f} ({100 * gflops / peak:.0f}%)" if peak else f"{gflops:.0f}"

    for name, (_, flops) in ops.items():
        t_torch = statistics.median(results[name]["torch"])
        t_iris = statistics.median(results[name]["iris"])
        print(f"| {name} | {1e3 * t_torch:.1f} | {1e3 * t_iris:.1f} | {t_torch / t_iris:.2f} | "
              f"{rate(flops, t_torch)} | {rate(flops, t_iris)} |")


if __name__ == "__main__":
    main()
