#!/usr/bin/env bash
# Throughput, latency and the engine's share of step time at several request rates:
# `iris bench` in process (built-in CPU device, tiny model, dummy weights), each rate repeated,
# medians reported. Usage: tools/bench/rates.sh [PROMPTS] [REPEATS] [RATES...]
set -euo pipefail
cd "$(dirname "$0")/../.."
prompts=${1:-200}
repeats=${2:-3}
shift 2 || true
rates=("$@")
[ ${#rates[@]} -gt 0 ] || rates=(5 10 20 40 inf)
cargo build --release -p iris >/dev/null
out=$(mktemp -d)
for rate in "${rates[@]}"; do
  for r in $(seq 1 "$repeats"); do
    ./target/release/iris bench --no-progress --num-prompts "$prompts" --request-rate "$rate" \
      --result-json "$out/$rate-$r.json" >/dev/null 2>&1
  done
done
python3 - "$out" "$repeats" "${rates[@]}" <<'PY'
import json, statistics, sys
out, repeats, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| rate (req/s) | requests/s | images/s | tokens/s | p50 ms | p90 ms | p99 ms | engine overhead | leaked bytes |")
print("|---|---|---|---|---|---|---|---|---|")
for rate in rates:
    runs = [json.load(open(f"{out}/{rate}-{r}.json")) for r in range(1, repeats + 1)]
    med = lambda f: statistics.median(f(j) for j in runs)
    print(f"| {rate} | {med(lambda j: j['throughput']['requests_per_s']):.2f} "
          f"| {med(lambda j: j['throughput']['images_per_s']):.2f} "
          f"| {med(lambda j: j['throughput']['tokens_per_s']):.0f} "
          f"| {med(lambda j: j['latency_ms']['p50']):.0f} "
          f"| {med(lambda j: j['latency_ms']['p90']):.0f} "
          f"| {med(lambda j: j['latency_ms']['p99']):.0f} "
          f"| {100 * med(lambda j: j['engine']['overhead_share']):.1f}% "
          f"| {max(j['leaked_bytes'] for j in runs)} |")
PY
rm -rf "$out"
