#!/usr/bin/env bash
# The second KV tier on the default model, 2 threads, alternating ROUNDS times:
# 1. preemption under memory pressure: a KV cache sized for about half of the load's tokens, so
#    requests are preempted as they grow, served with preemption by recompute (no tier), with a
#    tier in host memory (`--swap-space`, the cost model choosing) and with a tier in a file
#    (`--kv-offload-dir`);
# 2. prefix spill-over: 8 shared 1,024-token prefixes over a KV cache that holds about three,
#    served without a tier (evicted prefixes are prefilled again) and with one (they come back
#    from the tier).
# `kiln bench serve` reports output tok/s and TTFT; /metrics the preemptions by mode, the blocks
# moved and the hits in the cache and in the tier.
#
#   scripts/bench/swap.sh [OUT_DIR]    (ROUNDS=2; ONLY=preempt or ONLY=spill for one part;
#                                       NUM_PROMPTS=48 CONCURRENCY=16 INPUT_LEN=512
#                                       OUTPUT_LEN=256 KV_MEMORY=110MiB for the first;
#                                       OFFLOAD_DIR=/path/on/ssd for the file tier)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-bench-results/swap}"
mkdir -p "$OUT"
MODEL="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln
KILN="${CARGO_TARGET_DIR:-target}/release/kiln"
PORT=8093
ROUNDS="${ROUNDS:-2}"
NUM_PROMPTS="${NUM_PROMPTS:-48}"
CONCURRENCY="${CONCURRENCY:-16}"
INPUT_LEN="${INPUT_LEN:-512}"
OUTPUT_LEN="${OUTPUT_LEN:-256}"
# 16 requests of 768 tokens need ~13,000 token slots; 110 MiB of f16 KV holds ~6,200.
KV_MEMORY="${KV_MEMORY:-110MiB}"
OFFLOAD_DIR="${OFFLOAD_DIR:-$OUT/offload}"
SERVER_PID=

wait_ready() {
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "server did not start" >&2
  return 1
}

start() { # name, extra serve args...
  local name="$1"
  shift
  "$KILN" serve --model "$MODEL" --served-model-name gemma-3-270m --port "$PORT" --threads 2 \
    --disable-log-requests "$@" 2>"$OUT/server-$name.log" &
  SERVER_PID=$!
  wait_ready
}

stop() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop EXIT

metrics() { # name, round
  curl -s "http://127.0.0.1:$PORT/metrics" \
    | grep -E '^kiln:(num_preemptions(_by_mode)?|kv_swapped_(out|in)_blocks|kv_tier_(spilled_blocks|prefix_hits)|prefix_cache_(queries|hits))_total' \
    | tee -a "$OUT/$1-$2.txt"
}

run() { # name, round, extra serve args...
  local name="$1" round="$2"
  shift 2
  start "$name" --kv-cache-memory "$KV_MEMORY" --max-model-len 1024 "$@"
  "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --ignore-eos --max-concurrency "$CONCURRENCY" --seed 5 \
    --percentile-metrics ttft,tpot,e2el --metric-percentiles 50,95 --no-progress \
    --label "$name round $round" --save-result "$OUT/$name-$round.json" \
    | tee "$OUT/$name-$round.txt"
  metrics "$name" "$round"
  stop
}

# 8 prefixes of 1,024 tokens + 64 + 32 each; 64 MiB of f16 KV (18 KiB per token) holds ~3,600
# tokens: about three prefixes with their requests.
run_prefix() { # name, round, extra serve args...
  local name="$1" round="$2"
  shift 2
  start "$name" --kv-cache-memory 64MiB --max-model-len 2048 "$@"
  "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m \
    --dataset prefix-repetition --prefix-len 1024 --num-prefixes 8 --num-prompts 64 \
    --input-len 64 --output-len 32 --ignore-eos --max-concurrency 2 --seed 7 \
    --percentile-metrics ttft,e2el --metric-percentiles 50,95 --no-progress \
    --label "$name round $round" --save-result "$OUT/$name-$round.json" \
    | tee "$OUT/$name-$round.txt"
  metrics "$name" "$round"
  stop
}

mkdir -p "$OFFLOAD_DIR"
for round in $(seq "$ROUNDS"); do
  if [ "${ONLY:-preempt}" = preempt ]; then
    run recompute "$round"
    run swap-memory "$round" --swap-space 1
    run swap-file "$round" --kv-offload-dir "$OFFLOAD_DIR" --kv-offload-size 1GiB
  fi
  if [ "${ONLY:-spill}" = spill ]; then
    run_prefix prefix-no-tier "$round"
    run_prefix prefix-tier "$round" --swap-space 1
  fi
done
