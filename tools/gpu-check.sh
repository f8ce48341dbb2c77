#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU: everything about the CUDA plugin that CI, which
# has no GPU, cannot check. From the repository root:
#
#   tools/gpu-check.sh [--out DIR] [--quick] [--debug]
#
# Steps, each recorded as pass, fail or skip with its time and a detail:
#   build        cargo build --release of iris and the CUDA plugin
#   gpu          the GPU as nvidia-smi sees it (name, driver, memory)
#   devices      `iris devices --json` lists the cuda plugin with at least one device
#   plugin-check `iris plugin check cuda --json` on every ordinal (the conformance suite)
#   encode       `iris encode --device cuda` against the CPU device on the golden fixtures of
#                the three towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), in f32 and bf16
#   bench        the seed experiment, `iris bench --device cuda`: its verdict (device memory back
#                to the post-start baseline), 0 bytes leaked, and device memory compared with
#                nvidia-smi before, during and after the run
#   transformers where Python has torch and transformers: the Qwen2-VL-2B and Qwen2.5-VL-7B
#                towers in bf16 against transformers with its best attention on the same GPU
#                (tools/gpu-check/towers_vs_transformers.py)
#
# It prints one summary table and writes it as JSON to DIR/summary.json (default DIR:
# target/gpu-check), next to every command's output. Exit status: 0 when every step that ran
# passed, 1 when one failed, 2 when there is no usable GPU (the GPU steps are then skipped,
# with the plugin's reason).
#
# --quick shortens the bench (200 prompts) and the transformers comparison (2 repeats).
# --debug uses a debug build instead of release: for trying the script's own steps on a machine
# without a GPU, where the release build's time buys nothing.
# Environment: SKIP (steps not to run, comma-separated: plugin-check, encode, bench,
# transformers), BENCH_ARGS (extra `iris bench` flags), ENCODE_TOLERANCE_F32 and
# ENCODE_TOLERANCE_BF16 (relative L2 error allowed against the CPU device; defaults 1e-4 and
# 2e-2), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

out="target/gpu-check"
quick=0
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --debug) profile=debug; shift ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 64 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
python="${PYTHON:-python3}"
tol_f32="${ENCODE_TOLERANCE_F32:-1e-4}"
tol_bf16="${ENCODE_TOLERANCE_BF16:-2e-2}"
iris="$root/target/$profile/iris"
steps="$out/steps.tsv"
: > "$steps"
export IRIS_PLUGIN_PATH="$root/target/$profile"
export NO_COLOR=1

# record NAME STATUS SECONDS DETAIL
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ')" >> "$steps"
  printf '%-28s %-5s %7ss  %s\n' "$1" "$2" "$3" "$4"
}

# run NAME LOGFILE COMMAND...: runs a command, records pass/fail with its time.
run() {
  local name="$1" log="$2"
  shift 2
  local start end status
  start=$(date +%s.%N)
  "$@" > "$log" 2>&1
  status=$?
  end=$(date +%s.%N)
  local seconds
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  if [ "$status" -eq 0 ]; then
    record "$name" pass "$seconds" "log: $log"
  else
    record "$name" fail "$seconds" "exit $status; $(tail -n 3 "$log" | tr '\n' ' ')"
  fi
  return "$status"
}

skip() { record "$1" skip 0 "$2"; }

# wanted STEP: whether STEP is not listed in $SKIP.
wanted() { case ",${SKIP:-}," in *",$1,"*) return 1 ;; *) return 0 ;; esac; }

echo "== iris GPU check, results in $out"

# --- build ------------------------------------------------------------------------------------
build_flags=(-p iris -p iris-device-cuda)
[ "$profile" = release ] && build_flags+=(--release)
if ! run build "$out/build.log" cargo build "${build_flags[@]}"; then
  echo "the build failed; see $out/build.log" >&2
fi

# --- the GPU ----------------------------------------------------------------------------------
gpu_name="none"
if command -v nvidia-smi > /dev/null 2>&1 \
  && nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader > "$out/nvidia-smi.csv" 2>&1; then
  gpu_name=$(head -n 1 "$out/nvidia-smi.csv" | cut -d, -f2 | sed 's/^ *//')
  record gpu pass 0 "$(tr '\n' ';' < "$out/nvidia-smi.csv")"
else
  skip gpu "nvidia-smi not found or failed"
fi

# --- iris devices -----------------------------------------------------------------------------
devices=0
if [ -x "$iris" ] && run devices "$out/devices.json" "$iris" devices --json; then
  read -r devices reason < <("$python" - "$out/devices.json" <<'EOF'
import json, sys
listing = json.load(open(sys.argv[1]))
cuda = [p for p in listing["plugins"] if p["name"] == "cuda" and not p.get("error")]
if not cuda:
    print(0, "the cuda plugin is not listed (was libiris_device_cuda.so built?)")
else:
    p = cuda[0]
    print(len(p["devices"]), (p.get("reason") or "").replace("\n", " "))
EOF
)
  if [ "${devices:-0}" -gt 0 ]; then
    record devices.cuda pass 0 "$devices device(s)"
  else
    record devices.cuda skip 0 "no CUDA device: ${reason:-unknown}"
  fi
else
  skip devices.cuda "iris did not build or did not run"
fi

if [ "${devices:-0}" -gt 0 ]; then
  # --- conformance on every ordinal -----------------------------------------------------------
  if wanted plugin-check; then
    run plugin-check "$out/plugin-check.json" "$iris" plugin check cuda --json
  else
    skip plugin-check "in SKIP"
  fi

  # --- encode: CUDA against the CPU device on the golden fixtures -------------------------------
  models=(qwen2_vl qwen2_5_vl qwen3_vl)
  wanted encode || { skip encode "in SKIP"; models=(); }
  for model in "${models[@]}"; do
    for dtype in f32 bf16; do
      name="encode.$model.$dtype"
      dir="tests/data/golden/$model"
      images=(tests/data/golden/images/tower_a.png tests/data/golden/images/tower_b.jpg tests/data/golden/images/tower_c.png)
      if ! run "$name.cpu" "$out/$name.cpu.log" "$iris" encode --device cpu --model-dir "$dir" --dtype "$dtype" \
          --batch --out "$out/$name.cpu.safetensors" "${images[@]}"; then
        continue
      fi
      if ! run "$name.cuda" "$out/$name.cuda.log" "$iris" encode --device cuda --model-dir "$dir" --dtype "$dtype" \
          --batch --out "$out/$name.cuda.safetensors" "${images[@]}"; then
        continue
      fi
      tol="$tol_f32"
      [ "$dtype" = bf16 ] && tol="$tol_bf16"
      run "$name.compare" "$out/$name.compare.log" "$python" - "$out/$name.cpu.safetensors" \
        "$out/$name.cuda.safetensors" "$tol" <<'EOF'
import json, math, struct, sys

def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", (name, meta["dtype"])
        start, end = meta["data_offsets"]
        out[name] = struct.unpack(f"<{(end - start) // 4}f", body[start:end])
    return out

cpu, cuda, tol = tensors(sys.argv[1]), tensors(sys.argv[2]), float(sys.argv[3])
assert cpu.keys() == cuda.keys(), (sorted(cpu), sorted(cuda))
worst = 0.0
for name in sorted(cpu):
    a, b = cpu[name], cuda[name]
    assert len(a) == len(b), name
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    norm = math.sqrt(sum(x * x for x in a)) or 1.0
    rel = diff / norm
    worst = max(worst, rel)
    print(f"{name}: relative L2 error {rel:.3e}, max abs {max(abs(x - y) for x, y in zip(a, b)):.3e}")
print(f"worst relative L2 error {worst:.3e} (tolerance {tol:.1e})")
sys.exit(0 if worst <= tol else 1)
EOF
    done
  done

  # --- the seed experiment ----------------------------------------------------------------------
  if wanted bench; then
  bench_args=(--device cuda --no-progress --result-json "$out/bench.json" --plot "$out/bench-memory.svg")
  [ "$quick" -eq 1 ] && bench_args+=(--num-prompts 200)
  # shellcheck disable=SC2206 # BENCH_ARGS is a list of flags on purpose
  bench_args+=(${BENCH_ARGS:-})
  smi_log="$out/bench-nvidia-smi.csv"
  smi_pid=""
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 200 > "$smi_log" 2>&1 &
    smi_pid=$!
  fi
  sleep 1
  run bench "$out/bench.log" "$iris" bench "${bench_args[@]}"
  sleep 2
  if [ -n "$smi_pid" ]; then kill "$smi_pid" 2> /dev/null; wait "$smi_pid" 2> /dev/null; fi
  if [ -s "$out/bench.json" ]; then
    run bench.verdict "$out/bench.verdict.log" "$python" - "$out/bench.json" "$smi_log" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
verdict, memory = report["verdict"], report["memory"]
mib = lambda b: b / (1 << 20)
for point in ("before_start", "after_start", "after_load", "after_reset"):
    p = memory[point]
    print(f"{point:<13} device used {mib(p['device_used_bytes']):10.1f} MiB, allocator reserved "
          f"{mib(p['allocator_reserved_bytes']):10.1f} MiB, encoder cache {mib(p['encoder_cache_bytes']):8.1f} MiB")
peak_iris = max(p["point"]["device_used_bytes"] for p in report["timeline"]) if report["timeline"] else 0
try:
    rows = [l.split(",") for l in open(sys.argv[2]) if l.count(",") >= 2]
    used = [float(r[2]) for r in rows if r[1].strip() == "0"]
except (OSError, ValueError):
    used = []
if used:
    print(f"nvidia-smi (GPU 0): before {used[0]:.0f} MiB, peak {max(used):.0f} MiB, after {used[-1]:.0f} MiB; "
          f"iris's peak device-used figure {mib(peak_iris):.0f} MiB")
    # After the process exits every byte it held must be back.
    if used[-1] > used[0] + 64:
        print("nvidia-smi: memory after the run exceeds the memory before it by more than 64 MiB")
        sys.exit(1)
print(f"verdict: returned={verdict['returned']}, leaked {verdict['leaked_bytes']} bytes")
sys.exit(0 if verdict["returned"] and verdict["leaked_bytes"] == 0 else 1)
EOF
  else
    skip bench.verdict "no bench.json"
  fi
  else
    skip bench "in SKIP"
  fi

  # --- transformers on the same GPU -----------------------------------------------------------
  if ! wanted transformers; then
    skip transformers "in SKIP"
  elif "$python" -c "import torch, transformers; assert torch.cuda.is_available()" > /dev/null 2>&1; then
    repeats=5
    [ "$quick" -eq 1 ] && repeats=2
    run transformers "$out/transformers.log" "$python" tools/gpu-check/towers_vs_transformers.py \
      --iris "$iris" --repeats "$repeats" --json "$out/transformers.json"
  else
    skip transformers "Python with torch (CUDA) and transformers is not available"
  fi
else
  for step in plugin-check encode bench transformers; do
    skip "$step" "no CUDA device"
  done
fi

# --- summary ------------------------------------------------------------------------------------
"$python" - "$steps" "$out/summary.json" "$gpu_name" <<'EOF'
import json, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
steps = [{"name": r[0], "status": r[1], "seconds": float(r[2]), "detail": r[3] if len(r) > 3 else ""} for r in rows]
summary = {"gpu": sys.argv[3], "steps": steps,
           "passed": sum(s["status"] == "pass" for s in steps),
           "failed": sum(s["status"] == "fail" for s in steps),
           "skipped": sum(s["status"] == "skip" for s in steps)}
json.dump(summary, open(sys.argv[2], "w"), indent=2)
print()
print(f"GPU: {summary['gpu']}")
print(f"{'STEP':<28} {'STATUS':<6} {'SECONDS':>8}  DETAIL")
for s in steps:
    print(f"{s['name']:<28} {s['status']:<6} {s['seconds']:>8.1f}  {s['detail'][:110]}")
print(f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped")
print(f"summary written to {sys.argv[2]}")
EOF

if grep -q $'\tfail\t' "$steps"; then
  exit 1
fi
if [ "${devices:-0}" -eq 0 ]; then
  exit 2
fi
exit 0
