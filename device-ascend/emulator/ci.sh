#!/usr/bin/env bash
# The Ascend device end to end over the emulated CANN runtime, as CI runs it (.ci/run):
# `iris devices`, `iris plugin check ascend`, an encode compared with the CPU device, and a short
# bench that must return device memory to its post-start baseline. No NPU, no CANN SDK.
#
# The emulation is one shared library exposed under CANN's file names in an install folder;
# ASCEND_HOME_PATH points the plugin at it, as it would at a real CANN install.
set -euo pipefail
cd "$(dirname "$0")/../.."

target="${CARGO_TARGET_DIR:-target}"
cargo build --quiet -p iris -p iris-device-ascend -p iris-cann-emulator-lib

root="$target/ascend-emulated"
rm -rf "$root"
mkdir -p "$root/lib64"
emulator="$(cd "$target/debug" && pwd)/libiris_cann_emulator.so"
for lib in libacl_rt.so libnnopbase.so libopapi_math.so libopapi_nn.so libopapi_transformer.so; do
    ln -s "$emulator" "$root/lib64/$lib"
done

export ASCEND_HOME_PATH="$(cd "$root" && pwd)"
export ASCEND_EMU_HBM=8GiB
export IRIS_PLUGIN_PATH="$target/debug"
unset ASCEND_INSTALL_PATH ASCEND_TOOLKIT_HOME ASCEND_RT_VISIBLE_DEVICES
iris="$target/debug/iris"

echo "-- iris devices"
"$iris" devices

echo "-- iris plugin check ascend"
"$iris" plugin check ascend

echo "-- iris encode: ascend against cpu (f32, f16, bf16)"
cargo test --quiet -p iris --test ascend encode_on_the_emulated_npu_matches_the_cpu_device

echo "-- iris bench --device ascend (short seed experiment)"
"$iris" bench --device ascend --model tiny --weights dummy --max-num-batched-tokens 2048 \
    --num-prompts 40 --images-per-prompt 2 --image-size 112x112,224x168 --repeat-ratio 0.25 \
    --request-rate 20 --no-progress
