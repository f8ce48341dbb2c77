#!/usr/bin/env python3
"""Times PyTorch's scaled_dot_product_attention on the shapes attention_bench timed for iris,
on the same GPU, and prints both side by side.

    attention_vs_sdpa.py IRIS_RESULTS.jsonl [--json OUT]

IRIS_RESULTS.jsonl holds attention_bench's lines (one JSON object per shape and kernel: dtype,
heads, head_dim, segments, tokens per segment, engine (iris's own kernel, or cuDNN's fused
attention through iris's plugin), queries per block of iris's kernel, ms, tflops,
and expected_h100_tflops, the range docs/PERFORMANCE.md's model expects of the 64-query kernel on
an H100 at 1024 tokens and more, printed beside). SDPA gets q, k and v as [segments, heads,
tokens, head_dim] bf16 tensors: equal segments as one batch, the best case for PyTorch (the
towers' own code calls it per segment or through a varlen kernel); PyTorch picks its fastest
backend (flash or cuDNN attention on Ampere and later). Each shape is timed once, for every iris
kernel. Median of five samples of repeated calls, timed with CUDA events. Exit status 0 when
every shape ran.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F


def time_sdpa(segments, heads, head_dim, tokens):
    shape = (segments, heads, tokens, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 8 for _ in range(3))
    F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    F.scaled_dot_product_attention(q, k, v)
    end.record()
    torch.cuda.synchronize()
    calls = max(3, min(200, int(50.0 / max(start.elapsed_time(end), 1e-3))))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    samples.sort()
    return samples[len(samples) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    if not rows:
        print("no iris results", file=sys.stderr)
        return 1
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'head_dim':>8} {'segments':>8} {'tokens':>7} {'iris path':>9} {'iris ms':>9} "
          f"{'sdpa ms':>9} {'iris TFLOPS':>12} {'sdpa TFLOPS':>12} {'iris/sdpa time':>15} "
          f"{'H100 model':>11}")
    sdpa = {}
    for row in rows:
        segments = row.get("segments", 1)
        key = (segments, row["heads"], row["head_dim"], row["tokens"])
        if key not in sdpa:
            sdpa[key] = time_sdpa(*key)
        ms = sdpa[key]
        flops = 4.0 * segments * row["tokens"] ** 2 * row["head_dim"] * row["heads"]
        row["sdpa_ms"] = ms
        row["sdpa_tflops"] = flops / (ms * 1e-3) / 1e12
        row["iris_over_sdpa_time"] = row["ms"] / ms
        path = "cudnn" if row.get("engine") == "cudnn" else f"q{row.get('queries') or 64}"
        print(f"{row['head_dim']:>8} {segments:>8} {row['tokens']:>7} {path:>9} "
              f"{row['ms']:>9.3f} {ms:>9.3f} {row['tflops']:>12.1f} {row['sdpa_tflops']:>12.1f} "
              f"{row['iris_over_sdpa_time']:>15.2f} {row.get('expected_h100_tflops') or '-':>11}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
