#!/usr/bin/env bash
# Prefill/decode disaggregation on one machine (the default model; vllm-router 0.1.17 from PyPI
# in a venv under target/):
# 1. mechanism: the KV transfer between a prefill and a decode worker on loopback, per
#    1,000-token prompt (fetch time, bytes, rate), against the decode worker computing the
#    prompt itself (scripts/bench/pd_transfer.py);
# 2. a mixed workload: steady short requests (64 prompt tokens, 128 generated, 2 per second)
#    among long ones (4,000 prompt tokens, 0.1 per second), two `kiln bench serve` clients at
#    once; the short requests' ITL and TTFT percentiles, (a) colocated: one server on both cores
#    (--threads 2), (b) colocated on one core (--threads 1, taskset: what a decode worker's core
#    does when it also prefills), (c) disaggregated: a prefill worker on core 0 and a decode
#    worker on core 1 (--threads 1 each, taskset) behind vLLM's router in
#    --vllm-pd-disaggregation mode.
#
#   scripts/bench/pd.sh [OUT_DIR]    (ONLY=transfer or ONLY=mixed for one part; MIXED="colocated
#   colocated-1core disaggregated" by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-bench-results/pd}"
mkdir -p "$OUT"
# MODEL=FILE (with ONLY=transfer) measures the transfer on another model, e.g. a real shape
# written by scripts/bench/shape_gguf.py; N prompts (8).
MODEL="${MODEL:-$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)}"
cargo build --release -q -p kiln
KILN="${CARGO_TARGET_DIR:-target}/release/kiln"
VENV="${CARGO_TARGET_DIR:-target}/bench-router-venv"
[ -x "$VENV/bin/vllm-router" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q vllm-router==0.1.17; }
PIDS=()
COMMON=(--model "$MODEL" --served-model-name gemma-3-270m --max-model-len 8192
  --kv-cache-memory 1GiB --disable-log-requests)

wait_ok() { # url
  for _ in $(seq 600); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    sleep 0.2
  done
  echo "$1 never answered" >&2
  return 1
}

stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

start_pair() {
  taskset -c 0 "$KILN" serve "${COMMON[@]}" --port 8201 --threads 1 --kv-role prefill \
    --kv-transfer-port 8211 2>"$OUT/prefill.log" &
  PIDS+=($!)
  taskset -c 1 "$KILN" serve "${COMMON[@]}" --port 8202 --threads 1 --kv-role decode \
    2>"$OUT/decode.log" &
  PIDS+=($!)
  wait_ok http://127.0.0.1:8201/health
  wait_ok http://127.0.0.1:8202/health
}

mixed() { # label, base url
  "$KILN" bench serve --base-url "$2" --model gemma-3-270m --dataset random \
    --input-len 4000 --output-len 8 --ignore-eos --request-rate 0.1 --num-prompts 4 \
    --seed 5 --no-progress --label "$1-long" --save-result "$OUT/$1-long.json" \
    >"$OUT/$1-long.txt" &
  local long=$!
  "$KILN" bench serve --base-url "$2" --model gemma-3-270m --dataset random \
    --input-len 64 --output-len 128 --ignore-eos --request-rate 2 --num-prompts 80 \
    --seed 6 --no-progress --percentile-metrics ttft,itl,e2el --metric-percentiles 50,95,99 \
    --label "$1-short" --save-result "$OUT/$1-short.json" >"$OUT/$1-short.txt"
  wait "$long"
}

if [ "${ONLY:-transfer}" = transfer ]; then
  start_pair
  python3 scripts/bench/pd_transfer.py http://127.0.0.1:8201 http://127.0.0.1:8202 "${N:-8}" 1000 \
    | tee "$OUT/transfer.json"
  stop_all
fi
colocated() { # label, cores, threads
  taskset -c "$2" "$KILN" serve "${COMMON[@]}" --port 8203 --threads "$3" 2>"$OUT/$1.log" &
  PIDS+=($!)
  wait_ok http://127.0.0.1:8203/health
  mixed "$1" http://127.0.0.1:8203
  stop_all
}

disaggregated() {
  start_pair
  "$VENV/bin/vllm-router" --host 127.0.0.1 --port 8200 --vllm-pd-disaggregation \
    --policy round_robin --prefill http://127.0.0.1:8201 --decode http://127.0.0.1:8202 \
    --log-level warning --prometheus-host 127.0.0.1 --prometheus-port 8209 \
    >"$OUT/router.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 300); do
    if curl -sf -o /dev/null http://127.0.0.1:8200/v1/completions \
      -H 'Content-Type: application/json' -d '{"prompt": "hi", "max_tokens": 1}'; then break; fi
    sleep 0.2
  done
  mixed disaggregated http://127.0.0.1:8200
  curl -s http://127.0.0.1:8202/metrics | grep -E '^kiln:kv_transfer_(blocks|failures)_total' \
    >"$OUT/disaggregated-decode-metrics.txt"
  stop_all
}

if [ "${ONLY:-mixed}" = mixed ]; then
  for run in ${MIXED:-colocated colocated-1core disaggregated}; do
    case "$run" in
      colocated) colocated colocated 0,1 2 ;;
      colocated-1core) colocated colocated-1core 1 1 ;;
      disaggregated) disaggregated ;;
    esac
  done
fi
