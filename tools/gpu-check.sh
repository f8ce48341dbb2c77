#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU: everything about the CUDA plugin that CI, which
# has no GPU, cannot check. From the repository root:
#
#   tools/gpu-check.sh [--out DIR] [--quick] [--budget S] [--debug]   build here, then check
#   tools/gpu-check.sh --archive FILE [--debug]               build the prebuilt archive only
#   ./gpu-check.sh --prebuilt DIR [--out DIR] [--quick] [--budget S]
#                                                             check from an unpacked archive
#
# A GPU node often has neither a Rust toolchain nor a network. `--archive FILE` builds, on any
# x86-64 Linux machine with cargo, everything the checks need into one .tar.gz (well under
# 64 MiB, stripped): the iris binary; the CUDA plugin (one library for CUDA 12's and CUDA 13's
# user-space libraries) with its GPU test binary (tests/ops.rs) and the attention timing
# (examples/attention_bench.rs) beside it; the golden fixtures; this script and its Python
# helpers. On the GPU node: `tar xzf iris-gpu-check.tar.gz && iris-gpu-check/gpu-check.sh
# --prebuilt iris-gpu-check`. Without --prebuilt the same bundle is built from this checkout
# (target/gpu-check-bundle) and checked.
#
# Steps, each recorded as pass, fail or skip with its time and a detail:
#   build        (not with --prebuilt) the bundle: cargo build of iris, the CUDA plugin, its
#                GPU tests and the attention timing
#   gpu          the GPU as nvidia-smi sees it (name, driver, memory)
#   libraries    cuBLAS and NVRTC where the host's Python keeps them (pip's nvidia/*/lib in
#                its site-packages), named to the plugin in IRIS_CUDA_LIB_PATH
#   plugin       which CUDA major's libraries the plugin loaded here and why not the other
#                (the `cuda_libraries` property `iris devices` shows), or why it has no device
#   devices      `iris devices --json` lists the cuda plugin with at least one device, and the
#                paths device 0 chose at open, each with why (devices.attention_engine: cuDNN
#                or the plugin's kernels; devices.attention_q128, devices.elementwise_lanes,
#                devices.kernels)
#   plugin-check `iris plugin check cuda --json` on every ordinal (the conformance suite)
#   ops-gpu      the plugin's GPU test scenarios (tests/ops.rs: every op against an f64 host
#                reference; with two GPUs or more, every ordinal open at once in one process)
#   encode       `iris encode --device cuda` against the CPU device on the golden fixtures of
#                the three towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), in f32 and bf16
#   bench        the seed experiment, `iris bench --device cuda` on the tiny model, and
#   bench.7b     the same at real size: the Qwen2.5-VL-7B tower (preset qwen2.5-vl-7b, dummy
#                weights, bf16). Each is followed by its verdict step (bench.verdict,
#                bench.7b.verdict: tools/gpu-check/bench_verdict.py): device memory back to the
#                post-start baseline with 0 bytes leaked, as the --result-json says, and, from
#                nvidia-smi sampled every 200 ms from before the run to after the process
#                exited, no more than 64 MiB held after it than before it
#   first        single 448x448 images one after another (12 requests, one at a time) through
#                Qwen2.5-VL-7B and Qwen3-VL-8B (--quick: Qwen3-VL only), dummy weights, bf16:
#                after start-up, the slowest request within 1.2 times the median
#                (bench_verdict.py --first-within), memory as for the benches, and
#                first.T.gemm: the cuBLASLt problems first met after start-up, from the plugin's
#                debug log (how many, their heuristic searches and first calls, which include
#                kernels loaded lazily); when a tower
#                fails it, the same run again with CUDA_MODULE_LOADING=EAGER (first.T.eager),
#                with the plugin's attention kernels (first.T.kernel: no cuDNN plan built
#                while serving) and with both (first.T.both), to name what the first request
#                pays for
#   profile      `iris profile` dry and real at Qwen2.5-VL-7B's size (bf16): the same arena,
#                within 5% of the live peak of the step's tensors (profile.verdict)
#   attention    attention_bench: bf16 attention, 16 heads, head dims 64/72/80/96/128, one
#                segment of 256 to 16384 tokens, and the towers' packed launches at the serving
#                step (41x784 at 72, 8x1024 and 512x64 at 80), each with the 64-query kernel,
#                at 64/72/80 the 128-query one, and cuDNN's fused attention through the plugin
#                (`attention_engine = "cudnn"`, where libcudnn.so.9 loads and passes the check
#                at open); with torch, PyTorch's SDPA on the same shapes
#                (tools/gpu-check/attention_vs_sdpa.py). bf16 at these head dims runs the
#                tensor-core kernel; expected on an H100 at 1024 tokens and more: 220 to 380
#                TFLOPS by head dim (printed per shape), iris's time within 1.5 times SDPA's
#                with FlashAttention-2, within 2 times with cuDNN's Hopper kernel
#                (docs/PERFORMANCE.md has the model)
#   transformers where Python has torch and transformers: the Qwen2-VL-2B, Qwen2.5-VL-7B and
#                Qwen3-VL-8B towers in bf16, at 1, 4 and 32 images of 448x448 per call, against
#                transformers with its best attention on the same GPU and inputs: each side timed
#                in one process at steady state (median of the calls after the first, the first
#                call reported apart), with its achieved TFLOPS and share of the GPU's bf16 peak
#                (measured there with a bf16 matmul) (tools/gpu-check/towers_vs_transformers.py)
#   serving      `iris bench` on each tower at full steps (dummy weights, bf16, 960 distinct
#                images of 448x448 at --request-rate inf; --quick: Qwen3-VL-8B, 480 images), its
#                achieved TFLOPS against the measured peak, each with its memory verdict; and
#                Qwen3-VL-8B again with the plugin's attention kernels instead of cuDNN's
#                (`attention_engine = "kernel"`, serving.qwen3-vl-8b.kernel), with its 64-query
#                kernel only (serving.qwen3-vl-8b.q64) and with `elementwise_lanes = "1"`
#                (serving.qwen3-vl-8b.lanes1)
#   kernels      where ncu (Nsight Compute) runs: every kernel of one Qwen3-VL-8B pass over 41
#                images of 448x448, timed by ncu (with its DRAM bytes and SM throughput) and
#                summed by category beside the per-kernel model (tools/gpu-check/kernel_model.py)
#   cudnn.plans  the cuDNN plans the bench steps built after open, on the plugin's own thread
#                (their logs at IRIS_LOG=warn,iris::plugin=info): how many, the median and
#                longest build, the shapes cuDNN had none for, and what the resets' trims gave
#                back with the plans they dropped
#
# It prints one summary table and writes it as JSON to DIR/summary.json (default DIR:
# target/gpu-check, or gpu-check-results beside the bundle with --prebuilt), next to every
# command's output. Exit status: 0 when every step that ran passed, 1 when one failed, 2 when
# there is no usable GPU (the GPU steps are then skipped, with the plugin's reason).
# The whole check is sized for under ten minutes on one GPU, --quick for under six on an H200.
#
# --quick shortens the tiny bench (200 prompts) and the 7B one (300 prompts at 30 requests/s,
# 10 s of load; the default is 1000 at 20, 50 s), the attention timing (1024 and 4096 tokens)
# and the transformers comparison (3 timed calls per case instead of 10).
# --budget SECONDS bounds the whole check (default 540 with --quick, none without; 0: none): a
# step that would start after it is skipped, one still running when it ends is stopped and
# recorded as skipped with the time it had, so that a host that ends the command at a fixed
# limit (ten minutes, say) still gets every finished step and the summary. Steps run in order of
# what they check: the memory promise and first requests before the timings.
# --debug uses a debug build instead of release: for trying the script's own steps on a machine
# without a GPU, where the release build's time buys nothing.
# Environment: SKIP (steps not to run, comma-separated: plugin-check, ops-gpu, encode, bench,
# first, profile, attention, transformers, serving, kernels; bench covers both benches),
# BENCH_ARGS (extra `iris bench` flags, for both benches), ENCODE_TOLERANCE_F32 and ENCODE_TOLERANCE_BF16 (relative L2 error allowed
# against the CPU device; defaults 1e-4 and 2e-2), SMI_GPU (the nvidia-smi index of the GPU iris
# runs on, for the benches' cross-check; default 0), PYTHON (default python3).
set -uo pipefail
script_dir=$(cd "$(dirname "$0")" && pwd)

out=""
quick=0
budget=""
profile=release
prebuilt=""
archive=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    --debug) profile=debug; shift ;;
    --prebuilt) prebuilt="$2"; shift 2 ;;
    --archive) archive="$2"; shift 2 ;;
    --budget) budget="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 64 ;;
  esac
done
python="${PYTHON:-python3}"
case "$budget" in
  '') budget=0; [ "$quick" -eq 1 ] && budget=540 ;;
  *[!0-9]*) echo "--budget: expected whole seconds, got '$budget'" >&2; exit 64 ;;
esac
check_start=$(date +%s)

# make_bundle DIR STRIP: builds iris, the CUDA plugin with its GPU test binary and the attention
# timing, and copies them with the fixtures and helpers into DIR. Needs the checkout.
make_bundle() {
  local dir="$1" strip="$2" root flags=() target exe target_dir
  root=$(cd "$script_dir/.." && pwd)
  [ "$profile" = release ] && flags+=(--release)
  # Where cargo puts its output: CARGO_TARGET_DIR when set (relative to the checkout, where
  # cargo runs below), else the checkout's target folder.
  target_dir="${CARGO_TARGET_DIR:-target}"
  case "$target_dir" in /*) ;; *) target_dir="$root/$target_dir" ;; esac
  target="$target_dir/$profile"
  rm -rf "$dir"
  mkdir -p "$dir/bin" "$dir/gpu-check" "$dir/cuda" || return 1
  (cd "$root" && cargo build "${flags[@]}" -p iris) || return 1
  cp "$target/iris" "$dir/bin/" || return 1
  (cd "$root" && cargo build "${flags[@]}" -p iris-device-cuda --lib --example attention_bench) || return 1
  # The test binary's path, from cargo's JSON messages.
  exe=$(cd "$root" && cargo test "${flags[@]}" -p iris-device-cuda --test ops --no-run \
    --message-format=json 2> /dev/null | "$python" -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] == "ops":
        print(msg["executable"])')
  [ -n "$exe" ] || return 1
  cp "$target/libiris_device_cuda.so" "$target/examples/attention_bench" "$dir/cuda/" || return 1
  cp "$exe" "$dir/cuda/ops" || return 1
  cp -r "$root/tests/data/golden" "$dir/golden" || return 1
  cp "$script_dir/gpu-check.sh" "$dir/" || return 1
  cp "$script_dir"/gpu-check/*.py "$dir/gpu-check/" || return 1
  if [ "$strip" = 1 ]; then
    strip "$dir/bin/iris" "$dir/cuda/libiris_device_cuda.so" "$dir/cuda/ops" "$dir/cuda/attention_bench" || return 1
  fi
}

if [ -n "$archive" ]; then
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  if ! make_bundle "$stage/iris-gpu-check" 1; then
    echo "building the bundle failed" >&2
    exit 1
  fi
  tar -C "$stage" -czf "$archive" iris-gpu-check || exit 1
  echo "wrote $archive ($(du -h "$archive" | cut -f1)); on the GPU node:"
  echo "  tar xzf $(basename "$archive") && iris-gpu-check/gpu-check.sh --prebuilt iris-gpu-check"
  exit 0
fi

if [ -n "$prebuilt" ]; then
  bundle=$(cd "$prebuilt" && pwd) || exit 64
  [ -n "$out" ] || out="$bundle/../gpu-check-results"
else
  cd "$script_dir/.." || exit 1
  bundle="$(pwd)/target/gpu-check-bundle"
  [ -n "$out" ] || out="target/gpu-check"
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
tol_f32="${ENCODE_TOLERANCE_F32:-1e-4}"
tol_bf16="${ENCODE_TOLERANCE_BF16:-2e-2}"
iris="$bundle/bin/iris"
golden="$bundle/golden"
steps="$out/steps.tsv"
: > "$steps"
export NO_COLOR=1

# record NAME STATUS SECONDS DETAIL
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ')" >> "$steps"
  printf '%-28s %-5s %7ss  %s\n' "$1" "$2" "$3" "$4"
}

skip() { record "$1" skip 0 "$2"; }

# budget_left: seconds left of --budget (a large number when there is none).
budget_left() {
  if [ "$budget" -eq 0 ]; then
    echo 999999
  else
    echo $(( budget - ($(date +%s) - check_start) ))
  fi
}

# out_of_time NAME: skips step NAME (and says so) when --budget is spent.
out_of_time() {
  if [ "$(budget_left)" -le 0 ]; then
    skip "$1" "not run: the --budget of ${budget} s was spent"
    return 0
  fi
  return 1
}

# run NAME LOGFILE COMMAND...: runs a command, records pass/fail with its time. Under --budget,
# a step is not started once it is spent, and a program (not a shell function) still running
# when it ends is stopped and recorded as skipped.
run() {
  local name="$1" log="$2"
  shift 2
  out_of_time "$name" && return 1
  local start end status limit=()
  if [ "$budget" -gt 0 ] && [ "$(type -t "$1")" = file ]; then
    limit=(timeout --kill-after=10 "$(budget_left)")
  fi
  start=$(date +%s.%N)
  "${limit[@]}" "$@" > "$log" 2>&1
  status=$?
  end=$(date +%s.%N)
  local seconds
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  if [ "$status" -eq 0 ]; then
    record "$name" pass "$seconds" "log: $log"
  elif [ "${#limit[@]}" -gt 0 ] && { [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; } \
      && [ "$(budget_left)" -le 0 ]; then
    record "$name" skip "$seconds" "stopped at the --budget of ${budget} s; its output so far: $log"
  else
    record "$name" fail "$seconds" "exit $status; $(tail -n 3 "$log" | tr '\n' ' ')"
  fi
  return "$status"
}

# bench_step NAME FLAGS...: `iris bench --device cuda FLAGS` as step NAME, nvidia-smi logging
# device memory from a second before it to two seconds after its process exits, then NAME.verdict:
# tools/gpu-check/bench_verdict.py on its --result-json (memory back to the post-start baseline,
# 0 bytes leaked) and on the log (nothing left held once the process is gone).
# VERDICT_ARGS (an array, set by the caller) adds flags to the verdict.
bench_step() {
  local name="$1" smi_pid="" verdict=()
  shift
  out_of_time "$name" && return 1
  local json="$out/$name.json" smi_log="$out/$name-nvidia-smi.csv"
  rm -f "$json"
  verdict=("$json" "${VERDICT_ARGS[@]}")
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 200 > "$smi_log" 2>&1 &
    smi_pid=$!
    verdict+=("$smi_log")
  fi
  verdict+=(--gpu "${SMI_GPU:-0}")
  sleep 1
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags on purpose
  # The plugin's info lines: among them each cuDNN plan built after open and its time.
  run "$name" "$out/$name.log" env IRIS_LOG="${IRIS_LOG:-warn,iris::plugin=info}" \
    "$iris" bench --device cuda --no-progress --result-json "$json" \
    --plot "$out/$name-memory.svg" "$@" ${BENCH_ARGS:-}
  sleep 2
  if [ -n "$smi_pid" ]; then kill "$smi_pid" 2> /dev/null; wait "$smi_pid" 2> /dev/null; fi
  if [ -s "$json" ]; then
    run "$name.verdict" "$out/$name.verdict.log" "$python" "$bundle/gpu-check/bench_verdict.py" "${verdict[@]}"
  else
    skip "$name.verdict" "no $name.json: the $name step wrote no result"
  fi
}

VERDICT_ARGS=()

# gemm_problems NAME LOG: records NAME.gemm, what the cuBLASLt problems first met after
# start-up (after the bench's `engine:` line) cost in LOG: how many, their heuristic searches
# and first calls in all, and the slowest first call.
gemm_problems() {
  local name="$1" log="$2" summary
  [ -s "$log" ] || return 0
  summary=$(awk '
    /^engine: model/ { ready = 1; next }
    ready && /cuBLASLt problem / {
      match($0, /problem [0-9x]+/); shape = substr($0, RSTART + 8, RLENGTH - 8)
      match($0, /heuristic [0-9.]+ ms/); h = substr($0, RSTART + 10, RLENGTH - 13)
      match($0, /first matmul call [0-9.]+ ms/); c = substr($0, RSTART + 18, RLENGTH - 21)
      n++; heuristic += h; calls += c
      if (c + 0 > worst + 0) { worst = c; worst_shape = shape }
    }
    END {
      if (!ready) { print "no engine: line in the log"; exit }
      if (n == 0) { print "no cuBLASLt problem was new after start-up"; exit }
      printf "%d cuBLASLt problems new after start-up: heuristic %.1f ms, first calls %.1f ms in all (slowest %s, %.1f ms)", n, heuristic, calls, worst_shape, worst
    }' "$log")
  record "$name.gemm" pass 0 "$summary"
}

# wanted STEP: whether STEP is not listed in $SKIP.
wanted() { case ",${SKIP:-}," in *",$1,"*) return 1 ;; *) return 0 ;; esac; }

echo "== iris GPU check, results in $out"

# --- build ------------------------------------------------------------------------------------
if [ -z "$prebuilt" ]; then
  if ! run build "$out/build.log" make_bundle "$bundle" 0; then
    echo "the build failed; see $out/build.log" >&2
  fi
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

# --- cuBLAS and NVRTC from the host's Python ------------------------------------------------------
pip_libs=$("$python" - <<'EOF' 2> /dev/null
import glob, os, site
roots = list(site.getsitepackages()) + [site.getusersitepackages()]
dirs = []
for root in roots:
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))):
        if lib not in dirs:
            dirs.append(lib)
print(":".join(dirs))
EOF
)
if [ -n "$pip_libs" ]; then
  export IRIS_CUDA_LIB_PATH="${IRIS_CUDA_LIB_PATH:+$IRIS_CUDA_LIB_PATH:}$pip_libs"
  record libraries pass 0 "IRIS_CUDA_LIB_PATH=$IRIS_CUDA_LIB_PATH"
else
  skip libraries "no nvidia/*/lib in $python's site-packages; the loader path and CUDA_HOME are used"
fi

# --- what the plugin loaded here ----------------------------------------------------------------
# count_devices JSON: the cuda plugin's device count, then its reason or what it loaded (which
# CUDA major's libraries, and why not the other).
count_devices() {
  "$python" - "$1" <<'EOF'
import json, sys
listing = json.load(open(sys.argv[1]))
cuda = [p for p in listing["plugins"] if p["name"] == "cuda" and not p.get("error")]
if not cuda:
    print(0, "the cuda plugin is not listed")
else:
    p = cuda[0]
    loaded = [d.get("properties", {}).get("cuda_libraries", "") for d in p["devices"]]
    # One text per process: every device shows the libraries the process loaded.
    loaded = "; ".join(dict.fromkeys(l for l in loaded if l))
    print(len(p["devices"]), (p.get("reason") or loaded).replace("\n", " "))
EOF
}
plugin_dir="$bundle/cuda"
export IRIS_PLUGIN_PATH="$plugin_dir"
if [ -x "$iris" ]; then
  if "$iris" devices --json > "$out/devices.plugin.json" 2>&1; then
    read -r found why < <(count_devices "$out/devices.plugin.json")
    if [ "${found:-0}" -gt 0 ]; then
      record plugin pass 0 "$why"
    else
      skip plugin "no device: ${why:-unknown}"
    fi
  else
    record plugin fail 0 "iris devices failed; see $out/devices.plugin.json"
  fi
fi

# --- iris devices -----------------------------------------------------------------------------
devices=0
if [ -x "$iris" ] && run devices "$out/devices.json" "$iris" devices --json; then
  read -r devices reason < <(count_devices "$out/devices.json")
  if [ "${devices:-0}" -gt 0 ]; then
    record devices.cuda pass 0 "$devices device(s)"
    # The paths the plugin chose at open on this GPU, each with why (device 0).
    while IFS=$'\t' read -r key value; do
      record "devices.$key" pass 0 "$value"
    done < <("$python" - "$out/devices.json" <<'EOF'
import json, sys
listing = json.load(open(sys.argv[1]))
for p in listing["plugins"]:
    if p["name"] == "cuda" and p["devices"]:
        props = p["devices"][0].get("properties", {})
        for key in ("attention_engine", "attention_q128", "elementwise_lanes", "kernels"):
            if key in props:
                print(f"{key}\t{props[key]}")
        break
EOF
)
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

  # --- the plugin's GPU test scenarios ---------------------------------------------------------
  if wanted ops-gpu; then
    run ops-gpu "$out/ops-gpu.log" "$plugin_dir/ops" --exact --nocapture \
      every_op_matches_the_reference_on_this_machines_gpu
  else
    skip ops-gpu "in SKIP"
  fi

  # --- encode: CUDA against the CPU device on the golden fixtures -------------------------------
  models=(qwen2_vl qwen2_5_vl qwen3_vl)
  wanted encode || { skip encode "in SKIP"; models=(); }
  for model in "${models[@]}"; do
    for dtype in f32 bf16; do
      name="encode.$model.$dtype"
      dir="$golden/$model"
      images=("$golden/images/tower_a.png" "$golden/images/tower_b.jpg" "$golden/images/tower_c.png")
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

  # --- the seed experiment, on the tiny model and at Qwen2.5-VL-7B's size -----------------------
  if wanted bench; then
    tiny_args=()
    [ "$quick" -eq 1 ] && tiny_args+=(--num-prompts 200)
    bench_step bench "${tiny_args[@]}"
    # Real size: the 7B tower with dummy weights in bf16. --quick keeps the load at 10 s (300
    # prompts of 2 images at 30 requests/s: about 450 fresh encodes at some 7 ms each on an H200).
    # Images only (`{"video": 0}`): the workload has no video, and the figures stay those of
    # the image-sized step the earlier runs measured (vLLM's 14-frame video would size a step
    # of 114688 tokens).
    big_args=(--model qwen2.5-vl-7b --weights dummy --dtype bf16 --limit-mm-per-prompt '{"video": 0}')
    [ "$quick" -eq 1 ] && big_args+=(--num-prompts 300 --request-rate 30)
    # The CUDA device's own peak is the datasheet kind (SMs x clock x dense rate, about 1.35x
    # what a product reaches): the bench holds the encoder's achieved TFLOPS against an 8192^3
    # bf16 product's instead, measured by torch in a process that has exited before the bench
    # starts (so it holds no device memory the memory check would see).
    peak=$("$python" "$bundle/gpu-check/towers_vs_transformers.py" --measure-peak 2> "$out/peak.log" || true)
    case "$peak" in
      '' | *[!0-9.]*) echo "no measured peak (see $out/peak.log): bench.7b reports no share of peak" ;;
      *) big_args+=(--peak-tflops "$peak") ;;
    esac
    bench_step bench.7b "${big_args[@]}"
  else
    skip bench "in SKIP"
  fi

  # --- first requests: after start-up, the first image costs what the next ones do ------------
  # Single 448x448 images one after another: a request that pays what start-up left undone
  # (a library's search for a new problem size, kernels loaded on first use) is the slowest.
  if wanted first; then
    first_towers=(qwen2.5-vl-7b qwen3-vl-8b)
    [ "$quick" -eq 1 ] && first_towers=(qwen3-vl-8b)
    VERDICT_ARGS=(--first-within 1.2)
    first_args=(--weights dummy --dtype bf16 --limit-mm-per-prompt '{"video": 0}' --num-prompts 12
      --images-per-prompt 1 --image-size 448x448 --repeat-ratio 0 --max-concurrency 1 --request-rate inf)
    for tower in "${first_towers[@]}"; do
      # At debug level the plugin logs each cuBLASLt problem it meets for the first time, with
      # its heuristic search and first call times (kernels loaded lazily show in the latter).
      IRIS_LOG=warn,iris::plugin=debug bench_step "first.$tower" --model "$tower" "${first_args[@]}"
      first_status=$?
      gemm_problems "first.$tower" "$out/first.$tower.log"
      [ "$first_status" -eq 0 ] && continue
      # With the --budget spent, the runs below would only be recorded as not run.
      [ "$(budget_left)" -le 0 ] && continue
      # Slow first requests: the same run with each suspect taken away, so that one GPU run
      # names the cause. `.eager`: every kernel of every library loaded at start
      # (CUDA_MODULE_LOADING=EAGER) instead of at its first launch; `.kernel`: the plugin's
      # attention kernels, so no cuDNN plan is built (on the plugin's thread) while serving;
      # `.both`: both. What stays slow with both is cuBLASLt's per-size choice.
      first_kernel_config="$out/first-attention-kernel.toml"
      printf '[plugins.cuda]\nattention_engine = "kernel"\n' > "$first_kernel_config"
      CUDA_MODULE_LOADING=EAGER bench_step "first.$tower.eager" --model "$tower" "${first_args[@]}"
      bench_step "first.$tower.kernel" --config "$first_kernel_config" --model "$tower" "${first_args[@]}"
      CUDA_MODULE_LOADING=EAGER bench_step "first.$tower.both" --config "$first_kernel_config" \
        --model "$tower" "${first_args[@]}"
    done
    VERDICT_ARGS=()
  else
    skip first "in SKIP"
  fi

  # --- start-up sizing: the dry profile against the real step at Qwen2.5-VL-7B's size ------------
  # The dry run must report the arena the real step takes, exactly, and that arena must be within
  # 5% of the live peak of the step's tensors (what the CPU tests check, here with CUDA's
  # workspaces).
  if wanted profile; then
    profile_args=(--device cuda --model qwen2.5-vl-7b --weights dummy --dtype bf16 --warm-up off --json
      --limit-mm-per-prompt '{"video": 0}')
    if run profile.dry "$out/profile-dry.json" "$iris" profile "${profile_args[@]}" --profile dry &&
       run profile.real "$out/profile-real.json" "$iris" profile "${profile_args[@]}" --profile real; then
      run profile.verdict "$out/profile-verdict.log" "$python" "$bundle/gpu-check/profile_verdict.py" \
        "$out/profile-dry.json" "$out/profile-real.json"
    fi
  else
    skip profile "in SKIP"
  fi

  # --- attention against PyTorch's SDPA ---------------------------------------------------------
  if wanted attention; then
    attention_args=("$plugin_dir/libiris_device_cuda.so")
    [ "$quick" -eq 1 ] && attention_args+=(--quick)
    if run attention "$out/attention.jsonl" "$plugin_dir/attention_bench" "${attention_args[@]}"; then
      if "$python" -c "import torch; assert torch.cuda.is_available()" > /dev/null 2>&1; then
        run attention.sdpa "$out/attention-vs-sdpa.log" "$python" "$bundle/gpu-check/attention_vs_sdpa.py" \
          "$out/attention.jsonl" --json "$out/attention-vs-sdpa.json"
      else
        skip attention.sdpa "Python with torch (CUDA) is not available"
      fi
    fi
  else
    skip attention "in SKIP"
  fi

  # --- transformers on the same GPU -----------------------------------------------------------
  if ! wanted transformers; then
    skip transformers "in SKIP"
  elif "$python" -c "import torch, transformers; assert torch.cuda.is_available()" > /dev/null 2>&1; then
    repeats=10
    [ "$quick" -eq 1 ] && repeats=3
    run transformers "$out/transformers.log" "$python" "$bundle/gpu-check/towers_vs_transformers.py" \
      --iris "$iris" --repeats "$repeats" --json "$out/transformers.json"
  else
    skip transformers "Python with torch (CUDA) and transformers is not available"
  fi

  # --- the towers at the serving step: iris bench's achieved TFLOPS ------------------------------
  # Each tower's goal is stated at full 8192-token steps of 448x448 images: distinct images (no
  # cache hits) at --request-rate inf. --quick runs the Qwen3-VL tower only.
  if wanted serving; then
    serving_towers=(qwen2-vl-2b qwen2.5-vl-7b qwen3-vl-8b)
    serving_prompts=480
    [ "$quick" -eq 1 ] && serving_towers=(qwen3-vl-8b) && serving_prompts=240
    [ -n "${peak:-}" ] || peak=$("$python" "$bundle/gpu-check/towers_vs_transformers.py" --measure-peak 2> "$out/peak.log" || true)
    serving_peak=()
    case "$peak" in '' | *[!0-9.]*) ;; *) serving_peak=(--peak-tflops "$peak") ;; esac
    serving_args=(--weights dummy --dtype bf16 --limit-mm-per-prompt '{"video": 0}'
      --num-prompts "$serving_prompts" --images-per-prompt 2 --image-size 448x448 --repeat-ratio 0
      --request-rate inf "${serving_peak[@]}")
    for tower in "${serving_towers[@]}"; do
      bench_step "serving.$tower" --model "$tower" "${serving_args[@]}"
    done
    # The same Qwen3-VL step with the plugin's own attention kernels instead of cuDNN's (which
    # `attention_engine = auto` runs on Hopper where it passed its check at open), then with
    # the 64-query kernel only: what each changes end to end.
    kernel_config="$out/attention-kernel.toml"
    printf '[plugins.cuda]\nattention_engine = "kernel"\n' > "$kernel_config"
    bench_step "serving.qwen3-vl-8b.kernel" --config "$kernel_config" --model qwen3-vl-8b "${serving_args[@]}"
    q64_config="$out/attention-q64.toml"
    printf '[plugins.cuda]\nattention_engine = "kernel"\nattention_queries = "64"\n' > "$q64_config"
    bench_step "serving.qwen3-vl-8b.q64" --config "$q64_config" --model qwen3-vl-8b "${serving_args[@]}"
    # And with one column per thread in the elementwise kernels (epilogue, norms, rotary): what
    # the four-wide path changes end to end.
    lanes1_config="$out/elementwise-lanes1.toml"
    printf '[plugins.cuda]\nelementwise_lanes = "1"\n' > "$lanes1_config"
    bench_step "serving.qwen3-vl-8b.lanes1" --config "$lanes1_config" --model qwen3-vl-8b "${serving_args[@]}"
  else
    skip serving "in SKIP"
  fi

  # --- per kernel: Nsight Compute over one Qwen3-VL pass, beside the model ----------------------
  # One `iris encode --batch` of 41 images of 448x448 (the 8192-token step's), every kernel's
  # gpu__time_duration, DRAM bytes and SM throughput under ncu, summed by category by
  # tools/gpu-check/kernel_model.py beside its model of the same pass.
  if ! wanted kernels; then
    skip kernels "in SKIP"
  elif ! command -v ncu > /dev/null 2>&1; then
    skip kernels "Nsight Compute (ncu) is not on PATH"
  elif ! out_of_time kernels; then
    image448="$out/image-448.png"
    "$python" -c "import sys; sys.path.insert(0, sys.argv[1]); from towers_vs_transformers import write_png; write_png(sys.argv[2], 448)" \
      "$bundle/gpu-check" "$image448"
    images41=()
    for _ in $(seq 41); do images41+=("$image448"); done
    csv="$out/kernels-qwen3-vl-8b.csv" ncu_log="$out/kernels-ncu.log"
    rm -f "$csv"
    # ncu reports a profiling permission it lacks as an error line and may still exit 0: that
    # case is the host's set-up, a skip with the remedy; any other failure is the step's.
    ncu_start=$(date +%s)
    ncu_limit=()
    [ "$budget" -gt 0 ] && ncu_limit=(timeout --kill-after=10 "$(budget_left)")
    "${ncu_limit[@]}" ncu --csv --log-file "$csv" \
      --metrics gpu__time_duration.sum,dram__bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed \
      "$iris" encode --device cuda --model qwen3-vl-8b --weights dummy --dtype bf16 --batch \
      --out "$out/kernels-out.safetensors" "${images41[@]}" > "$ncu_log" 2>&1
    ncu_status=$?
    ncu_seconds=$(( $(date +%s) - ncu_start ))
    if grep -q "ERR_NVGPUCTRPERM" "$ncu_log" "$csv" 2> /dev/null; then
      skip kernels "ncu may not read the GPU's counters here (ERR_NVGPUCTRPERM: run as root, or load nvidia with NVreg_RestrictProfilingToAdminUsers=0)"
    elif [ "${#ncu_limit[@]}" -gt 0 ] && { [ "$ncu_status" -eq 124 ] || [ "$ncu_status" -eq 137 ]; } \
        && [ "$(budget_left)" -le 0 ]; then
      record kernels.ncu skip "$ncu_seconds" "stopped at the --budget of ${budget} s; its output so far: $ncu_log"
    elif [ "$ncu_status" -ne 0 ]; then
      record kernels.ncu fail "$ncu_seconds" "exit $ncu_status; $(tail -n 3 "$ncu_log" | tr '\n' ' ')"
    else
      record kernels.ncu pass "$ncu_seconds" "csv: $csv"
      run kernels "$out/kernels.log" "$python" "$bundle/gpu-check/kernel_model.py" --towers qwen3-vl-8b \
        --images 41 --ncu "$csv" --json "$out/kernels.json"
    fi
  fi
else
  for step in plugin-check ops-gpu encode bench first profile attention transformers serving kernels; do
    skip "$step" "no CUDA device"
  done
fi

# --- cuDNN plans built after open, from the bench steps' logs ---------------------------------------
# A plan is built on the plugin's own thread while the kernel computes its shape: how long the
# builds took says how many steps a new image size runs on the kernel.
if [ "${devices:-0}" -gt 0 ]; then
  plan_ms=$(cat "$out"/*.log 2> /dev/null | grep -o "cuDNN attention plan for .*: built in [0-9]* ms" |
    sed 's/.*built in \([0-9]*\) ms/\1/' | sort -n)
  plans_refused=$(cat "$out"/*.log 2> /dev/null | grep -c "cuDNN attention plan for .*: none, ")
  # What the resets' trims gave back with the plans they dropped (the bench's reset_all).
  trimmed=$(cat "$out"/*.log 2> /dev/null |
    grep -o "trim: dropped [0-9]* cuDNN plans built after open, which gave back [0-9]* bytes" |
    awk '{ plans += $3; bytes += $12 } END { printf "resets dropped %d plans, giving back %d bytes", plans, bytes }')
  if [ -n "$plan_ms" ]; then
    record cudnn.plans pass 0 "$(printf '%s\n' "$plan_ms" | awk -v refused="$plans_refused" -v trimmed="$trimmed" \
      '{ v[NR] = $1 } END { printf "%d built after open, median %d ms, max %d ms; %d shapes without a plan; %s", NR, v[int((NR + 1) / 2)], v[NR], refused, trimmed }')"
  else
    skip cudnn.plans "no bench log names a cuDNN plan built after open ($plans_refused shapes without one)"
  fi
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
