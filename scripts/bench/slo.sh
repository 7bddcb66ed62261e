#!/usr/bin/env bash
# Scheduling to latency targets on the default model, 2 threads: a bursty load (gamma arrivals,
# burstiness 0.5) at two rates, each run ~2 minutes, against the three fixed profiles and the
# batch controller holding a per-step target (`--target-itl-ms 60 --target-ttft-ms 1000`) or a
# per-request one (`--target-tpot-ms 60 --target-ttft-ms 1000`), goodput counted for
# TTFT <= 1 s and TPOT <= 60 ms; then mixed SLO classes at the higher rate (20 % interactive at
# priority 0, due in 1 s; 80 % batch at priority 1, due in 30 s), balanced profile, under fcfs
# and under the deadline policy with the classes and a 1 s TTFT target (steps sized to drain the
# queue, so an interactive prompt is not stuck behind a 2,048-token step).
#
#   scripts/bench/slo.sh [OUT_DIR]      (RATES="2 3" SECONDS_PER_RUN=120 to change the load;
#                                         CONFIGS="throughput controller-tpot" for some servers;
#                                         ONLY_MIXED=1 for the mixed-class runs alone,
#                                         NO_MIXED=1 to leave them out)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-bench-results/slo}"
mkdir -p "$OUT"
MODEL="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln
KILN="${CARGO_TARGET_DIR:-target}/release/kiln"
PORT=8091
RATES="${RATES:-2 3}"
SECONDS_PER_RUN="${SECONDS_PER_RUN:-120}"
INPUT_LEN=256
OUTPUT_LEN=128
SERVER_PID=

wait_ready() {
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "server did not start" >&2
  return 1
}

start() {
  "$KILN" serve --model "$MODEL" --served-model-name gemma-3-270m --port "$PORT" --threads 2 \
    --disable-log-requests "$@" 2>"$OUT/server-$NAME.log" &
  SERVER_PID=$!
  wait_ready
}

stop() {
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=
}
trap stop EXIT

bench() { # rate, name, extra bench args...
  local rate="$1" name="$2"
  shift 2
  local n
  n=$(awk -v r="$rate" -v s="$SECONDS_PER_RUN" 'BEGIN { printf "%d", r * s }')
  "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m \
    --num-prompts "$n" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos \
    --request-rate "$rate" --burstiness 0.5 --seed 11 --goodput ttft:1000 tpot:60 \
    --percentile-metrics ttft,tpot,itl --metric-percentiles 50,95 --no-progress \
    --label "$name r=$rate" --save-result "$OUT/$name-r$rate.json" "$@" | tee "$OUT/$name-r$rate.txt"
}

CONFIGS="${CONFIGS:-latency balanced throughput controller controller-tpot}"
if [[ -z "${ONLY_MIXED:-}" ]]; then
  for rate in $RATES; do
    for cfg in $CONFIGS; do
      NAME="$cfg-r$rate"
      case "$cfg" in
        controller) start --profile throughput --target-itl-ms 60 --target-ttft-ms 1000 ;;
        controller-tpot) start --profile throughput --target-tpot-ms 60 --target-ttft-ms 1000 ;;
        *) start --profile "$cfg" ;;
      esac
      bench "$rate" "$cfg"
      stop
    done
  done
fi

if [[ -n "${NO_MIXED:-}" ]]; then
  echo "results in $OUT"
  exit 0
fi

# Mixed classes at the higher rate: interactive (priority 0) and batch (priority 1).
rate="${RATES##* }"
# Same profile both times; the second adds the deadline policy and the two classes.
CLASSES='{"0": {"ttft_ms": 1000}, "1": {"ttft_ms": 30000}}'
NAME="mixed-fcfs"
start --profile balanced
bench "$rate" mixed-fcfs --priority-mix 0:0.2,1:0.8
stop
NAME="mixed-deadline"
start --profile balanced --scheduling-policy deadline --slo-classes "$CLASSES" --target-ttft-ms 1000
bench "$rate" mixed-deadline --priority-mix 0:0.2,1:0.8
stop

echo "results in $OUT"
