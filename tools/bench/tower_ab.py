#!/usr/bin/env python3
"""Qwen2-VL-2B vision tower, dummy weights: two iris binaries side by side on the CPU device.

For a change to iris itself: build the binary before and after the change, then run both in this
one script, alternating, on the same image (one 448x448 image, and a batch of four) with the same
thread count and dtype (`--dtype f32|bf16`, default f32; `--isa` forces the kernel tier). Times
are what `iris encode` prints per call (upload, tower, read-back) after one untimed warm-up call,
as in tower_vs_torch.py, whose image and timing code this script shares. Reports the median per
case and the ratio before / after. `--no-warmup` skips the warm-up call, for binaries older than
`iris encode --warmup`.

Usage (Python with numpy and Pillow, e.g. the virtual environment of tools/golden/README.md):
    git worktree add /tmp/iris-before <commit> && (cd /tmp/iris-before && cargo build --release -p iris)
    cargo build --release -p iris
    python tools/bench/tower_ab.py --before /tmp/iris-before/target/release/iris \
        --after target/release/iris --threads 2 --repeats 3
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tower_vs_torch import PATCH, make_image, time_iris, tower_flops  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the iris binary before the change")
    parser.add_argument("--after", required=True, help="the iris binary after the change")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                        help="the model's dtype (default f32)")
    parser.add_argument("--isa", help="force the kernel tier of both (IRIS_CPU_ISA)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no untimed warm-up call (binaries without `iris encode --warmup`)")
    args = parser.parse_args()

    binaries = {"before": args.before, "after": args.after}
    results = {count: {name: [] for name in binaries} for count in (1, 4)}
    with tempfile.TemporaryDirectory() as tmp:
        image = os.path.join(tmp, "image.png")
        make_image(image)
        config = os.path.join(tmp, "iris.toml")
        with open(config, "w") as f:
            f.write(f'device = "cpu"\n[plugins.cpu]\nthreads = {args.threads}\n')
        for repeat in range(args.repeats):
            for count in results:
                # Alternate which side goes first, so that neither always meets the same noise.
                order = list(binaries.items())
                if repeat % 2:
                    order.reverse()
                for name, binary in order:
                    results[count][name].append(
                        time_iris(binary, config, image, count, tmp, args.dtype, args.isa,
                                  warmup=not args.no_warmup))
                print(f"repeat {repeat + 1}/{args.repeats}, {count} image(s): "
                      + ", ".join(f"{name} {results[count][name][-1]:.2f} s" for name in binaries),
                      flush=True)

    patches = (448 // PATCH) ** 2
    print("\n| images | before median s | after median s | before / after | before GFLOP/s | after GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for count, times in results.items():
        flops = tower_flops(patches, count)
        before = statistics.median(times["before"])
        after = statistics.median(times["after"])
        print(f"| {count} | {before:.2f} | {after:.2f} | {before / after:.2f} | "
              f"{flops / before / 1e9:.0f} | {flops / after / 1e9:.0f} |")
        print("individual runs: before " + " / ".join(f"{t:.2f}" for t in times["before"])
              + ", after " + " / ".join(f"{t:.2f}" for t in times["after"]))


if __name__ == "__main__":
    main()
