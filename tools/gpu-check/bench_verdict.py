#!/usr/bin/env python3
"""The verdict of one `iris bench` run, from its --result-json file and, optionally, nvidia-smi.

Usage (tools/gpu-check.sh calls it after each bench step):
    python3 tools/gpu-check/bench_verdict.py BENCH_JSON [NVIDIA_SMI_CSV] [--gpu INDEX]
        [--first-within RATIO]

BENCH_JSON is what `iris bench --result-json` writes (cli/src/bench/report.rs, `to_json`): the
verdict is its top-level `memory_returned_to_baseline` and `leaked_bytes` (device used,
allocator reserved and allocator allocated after `reset_all`, against the post-start baseline),
with the four checkpoints under `memory` and the samples under `timeline`.

NVIDIA_SMI_CSV is the log of
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 200
started before the bench and stopped after its process exited: once the process is gone, every
byte it held must be back, so the last sample of GPU INDEX (default 0) may exceed the first by
at most SLACK_MIB (64 MiB: the driver's own bookkeeping moves by a few MiB). A log given without
any sample of that GPU fails: the cross-check was asked for and could not be done.

With --first-within RATIO (the `first` step: single-image requests one after another), the
slowest request's latency (`latency_ms.max`, the first request's when start-up left it work)
must also be at most RATIO times the median (`latency_ms.p50`).

Exit status: 0 when memory returned and 0 bytes leaked (and nvidia-smi agrees), 1 when not,
2 when BENCH_JSON lacks a key the verdict needs (the report and this script have drifted apart).
cli/tests/bench_verdict.rs runs this script on a real bench.json in CI.
"""

import argparse
import json
import sys

SLACK_MIB = 64
MIB = 1 << 20
CHECKPOINTS = ("before_start", "after_start", "after_load", "after_reset")
POINT_KEYS = ("device_used_bytes", "allocator_reserved_bytes", "allocator_allocated_bytes", "encoder_cache_bytes")


class Drift(Exception):
    """BENCH_JSON does not have the shape cli/src/bench/report.rs writes."""


def field(obj, key, kind, where):
    if not isinstance(obj, dict) or key not in obj:
        raise Drift(f"{where} has no `{key}`")
    value = obj[key]
    # bool is an int in Python; a count must not be one.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        name = kind.__name__ if isinstance(kind, type) else "a number"
        raise Drift(f"{where}.{key} is {value!r}, not {name}")
    return value


def read_report(path):
    with open(path) as f:
        report = json.load(f)
    returned = field(report, "memory_returned_to_baseline", bool, "bench.json")
    leaked = field(report, "leaked_bytes", int, "bench.json")
    memory = field(report, "memory", dict, "bench.json")
    points = {}
    for name in CHECKPOINTS:
        point = field(memory, name, dict, "bench.json memory")
        points[name] = {key: field(point, key, int, f"memory.{name}") for key in POINT_KEYS}
    timeline = field(report, "timeline", list, "bench.json")
    used = [field(field(p, "point", dict, "timeline[]"), "device_used_bytes", int, "timeline[].point") for p in timeline]
    latency = field(report, "latency_ms", dict, "bench.json")
    slowest = field(latency, "max", (int, float), "latency_ms")
    median = field(latency, "p50", (int, float), "latency_ms")
    return returned, leaked, points, used, (slowest, median)


def smi_samples(path, gpu):
    """memory.used in MiB of GPU `gpu`, in order, and the count of lines that did not parse."""
    samples, bad = [], 0
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.split(",")]
            if len(cells) < 3:
                bad += bool(line.strip())
                continue
            try:
                index, used = int(cells[1]), float(cells[2])
            except ValueError:
                bad += 1
                continue
            if index == gpu:
                samples.append(used)
    return samples, bad


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_json")
    parser.add_argument("nvidia_smi_csv", nargs="?")
    parser.add_argument("--gpu", type=int, default=0, help="the nvidia-smi index of the GPU the bench ran on")
    parser.add_argument("--first-within", type=float, metavar="RATIO",
                        help="the slowest request may take at most RATIO times the median")
    args = parser.parse_args()

    try:
        returned, leaked, points, timeline, (slowest, median) = read_report(args.bench_json)
    except Drift as err:
        print(f"{args.bench_json}: {err}; is it what `iris bench --result-json` writes today?")
        return 2
    problems = []
    for name in CHECKPOINTS:
        p = points[name]
        print(f"{name:<13} device used {p['device_used_bytes'] / MIB:10.1f} MiB, allocator reserved "
              f"{p['allocator_reserved_bytes'] / MIB:10.1f} MiB, allocated {p['allocator_allocated_bytes'] / MIB:10.1f} MiB, "
              f"encoder cache {p['encoder_cache_bytes'] / MIB:8.1f} MiB")
    if returned != (leaked == 0):
        problems.append(f"bench.json contradicts itself: memory_returned_to_baseline {returned} with leaked_bytes {leaked}")

    if args.nvidia_smi_csv:
        try:
            used, bad = smi_samples(args.nvidia_smi_csv, args.gpu)
        except OSError as err:
            used, bad = [], 0
            print(f"nvidia-smi: cannot read {args.nvidia_smi_csv}: {err}")
        if not used:
            problems.append(f"nvidia-smi: no memory.used sample of GPU {args.gpu} in {args.nvidia_smi_csv} "
                            f"({bad} unreadable lines); the cross-check cannot be done")
        else:
            peak_iris = max(timeline) / MIB if timeline else 0.0
            print(f"nvidia-smi (GPU {args.gpu}, {len(used)} samples): before {used[0]:.0f} MiB, peak {max(used):.0f} MiB, "
                  f"after {used[-1]:.0f} MiB; iris's peak device-used sample {peak_iris:.0f} MiB")
            if used[-1] > used[0] + SLACK_MIB:
                problems.append(f"nvidia-smi: memory after the run exceeds the memory before it by "
                                f"{used[-1] - used[0]:.0f} MiB (more than {SLACK_MIB} MiB)")

    if args.first_within is not None:
        ratio = slowest / median if median > 0 else float("inf")
        print(f"latency: slowest {slowest:.1f} ms, median {median:.1f} ms ({ratio:.2f}x; at most "
              f"{args.first_within:.2f}x)")
        if ratio > args.first_within:
            problems.append(f"the slowest request took {ratio:.2f} times the median (at most "
                            f"{args.first_within:.2f}): start-up left work to the first requests")

    answer = "yes" if returned else "no"
    print(f"verdict: memory after reset returns to the post-start baseline: {answer}, leaked {leaked} bytes")
    if not returned or leaked:
        problems.append(f"memory did not return to the post-start baseline ({leaked} bytes leaked)")
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
