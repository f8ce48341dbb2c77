#!/usr/bin/env python3
"""Criterion benchmark binaries side by side: each named binary runs the benchmarks matching a
filter in turn, round after round, and the script prints each benchmark's median time per binary
with every round's figure.

For a change to a kernel: build the bench binary before and after the change (`cargo bench -p
<crate> --bench <name> --no-run` in a worktree of the commit before, and here), then alternate
them on the same machine, so that both see the same noise. Plain Python, no packages.

Usage:
    python3 tools/bench/criterion_ab.py --rounds 3 --filter "gemm/bf16 avx" \\
        before=/tmp/before-target/release/deps/ops-<hash> after=target/release/deps/ops-<hash>
"""

import argparse
import re
import statistics
import subprocess
import sys

UNITS_MS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}


def run(binary, pattern, seconds):
    """One run of `binary` over the benchmarks matching `pattern`: {name: median ms}."""
    out = subprocess.run(
        [binary, "--bench", pattern, "--warm-up-time", "1", "--measurement-time", str(seconds),
         "--sample-size", "10", "--noplot", "--discard-baseline"],
        capture_output=True, text=True, check=True,
    ).stdout
    times, name = {}, None
    for line in out.splitlines():
        found = re.match(r"^(\S.*?)\s+time:\s+\[(.*)\]", line)
        if found:
            name, estimate = found.group(1), found.group(2)
        else:
            found = re.match(r"^\s+time:\s+\[(.*)\]", line)
            if not found:
                if line and not line[0].isspace() and not line.startswith(("Benchmarking", "Found", "Gnuplot", "WARNING", "Warning")):
                    name = line.strip()
                continue
            estimate = found.group(1)
        parts = estimate.split()
        # `[low unit estimate unit high unit]`; change lines (`[-1% +2% +3%]`) are skipped.
        if len(parts) == 6 and parts[3] in UNITS_MS and name:
            times[name] = float(parts[2]) * UNITS_MS[parts[3]]
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--filter", required=True, help="criterion's benchmark filter (a regex)")
    parser.add_argument("--seconds", type=int, default=5, help="measurement time per benchmark")
    parser.add_argument("binaries", nargs="+", help="label=path of each criterion binary")
    args = parser.parse_args()
    binaries = []
    for spec in args.binaries:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            parser.error(f"{spec!r}: expected label=path")
        binaries.append((label, path))
    results = {}
    for round_ in range(args.rounds):
        for label, path in binaries:
            for name, ms in run(path, args.filter, args.seconds).items():
                results.setdefault(name, {}).setdefault(label, []).append(ms)
            print(f"round {round_ + 1}/{args.rounds}: {label} done", file=sys.stderr)
    for name in sorted(results):
        cells = []
        for label, _ in binaries:
            runs = results[name].get(label, [])
            if runs:
                listed = " / ".join(f"{ms:.1f}" for ms in runs)
                cells.append(f"{label} {statistics.median(runs):.2f} ms ({listed})")
            else:
                cells.append(f"{label} -")
        print(f"{name} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
