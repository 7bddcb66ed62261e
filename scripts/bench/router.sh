#!/usr/bin/env bash
# kiln replicas behind vLLM's router (vllm-router 0.1.17 from PyPI, in a venv under target/):
# 1. prefix hit rate of a fleet: 8 shared 1,000-token prefixes x 64 requests (the default model,
#    one thread per replica), served by one replica directly, and by three replicas behind the
#    router with round_robin, cache_aware and kv_aware (the replicas publishing their KV cache
#    events with --kv-events-config); the hit rate is the replicas' summed
#    kiln:prefix_cache_hits_total over kiln:prefix_cache_queries_total for the run;
# 2. the router's added latency: TTFT of short requests (32 random prompt tokens) at
#    concurrency 1, in pairs to one replica directly and through the router, with round_robin
#    and with cache_aware (which asks the replica to render the prompt first).
# All replicas share this machine's cores, so fleet throughput is not measured here.
#
#   scripts/bench/router.sh [OUT_DIR]    (ONLY=hits or ONLY=latency for one part; PAIRS=200)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-bench-results/router}"
mkdir -p "$OUT"
MODEL="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln
KILN="${CARGO_TARGET_DIR:-target}/release/kiln"
VENV="${CARGO_TARGET_DIR:-target}/bench-router-venv"
[ -x "$VENV/bin/vllm-router" ] || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q vllm-router==0.1.17; }
PORTS=(8101 8102 8103)
ROUTER_PORT=8100
PIDS=()

wait_ok() { # url
  for _ in $(seq 600); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    sleep 0.2
  done
  echo "$1 never answered" >&2
  return 1
}

start_replicas() { # count, extra serve args...
  local count="$1"
  shift
  for i in $(seq 0 $((count - 1))); do
    local events=()
    if [ "${EVENTS:-0}" = 1 ]; then
      events=(--kv-events-config "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:$((8111 + i))\", \"replay_endpoint\": \"tcp://127.0.0.1:$((8121 + i))\"}")
    fi
    "$KILN" serve --model "$MODEL" --served-model-name gemma-3-270m --port "${PORTS[$i]}" \
      --threads 1 --max-model-len 2048 --disable-log-requests "${events[@]}" "$@" \
      2>"$OUT/replica-$i.log" &
    PIDS+=($!)
  done
  for i in $(seq 0 $((count - 1))); do wait_ok "http://127.0.0.1:${PORTS[$i]}/health"; done
}

start_router() { # policy, count
  local urls=()
  for i in $(seq 0 $(($2 - 1))); do urls+=("http://127.0.0.1:${PORTS[$i]}"); done
  "$VENV/bin/vllm-router" --host 127.0.0.1 --port "$ROUTER_PORT" --policy "$1" \
    --worker-urls "${urls[@]}" --worker-startup-check-interval 1 --log-level warning \
    --prometheus-host 127.0.0.1 --prometheus-port 8109 >"$OUT/router-$1.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 300); do
    if curl -sf -o /dev/null "http://127.0.0.1:$ROUTER_PORT/v1/completions" \
      -H 'Content-Type: application/json' -d '{"prompt": "hi", "max_tokens": 1}'; then return 0; fi
    sleep 0.2
  done
  echo "the router never served" >&2
  return 1
}

stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap stop_all EXIT

hits() { # count: "hits queries" summed over the replicas
  local h=0 q=0
  for i in $(seq 0 $(($1 - 1))); do
    local m
    m="$(curl -s "http://127.0.0.1:${PORTS[$i]}/metrics")"
    h=$((h + $(echo "$m" | awk '/^kiln:prefix_cache_hits_total/ {printf "%d", $2}')))
    q=$((q + $(echo "$m" | awk '/^kiln:prefix_cache_queries_total/ {printf "%d", $2}')))
  done
  echo "$h $q"
}

prefix_run() { # name, replicas, base url
  local before after
  before="$(hits "$2")"
  "$KILN" bench serve --base-url "$3" --model gemma-3-270m \
    --dataset prefix-repetition --prefix-len 1000 --num-prefixes 8 --num-prompts 64 \
    --input-len 64 --output-len 16 --ignore-eos --max-concurrency 4 --seed 11 \
    --percentile-metrics ttft,e2el --metric-percentiles 50,95 --no-progress \
    --label "$1" --save-result "$OUT/$1.json" >"$OUT/$1.txt"
  after="$(hits "$2")"
  read -r h0 q0 <<<"$before"
  read -r h1 q1 <<<"$after"
  echo "$1: prefix hit rate $(awk -v h=$((h1 - h0)) -v q=$((q1 - q0)) 'BEGIN {printf "%.3f (%d of %d tokens)", h / q, h, q}')" \
    | tee -a "$OUT/summary.txt"
}

: >"$OUT/summary.txt"
if [ "${ONLY:-hits}" = hits ]; then
  start_replicas 1
  prefix_run single 1 "http://127.0.0.1:${PORTS[0]}"
  stop_all
  for policy in ${POLICIES:-round_robin cache_aware kv_aware}; do
    # kv_aware places requests by the KV cache events the replicas publish (found through
    # their /kv_event_sources).
    EVENTS=$([ "$policy" = kv_aware ] && echo 1 || echo 0) start_replicas 3
    start_router "$policy" 3
    prefix_run "fleet-$policy" 3 "http://127.0.0.1:$ROUTER_PORT"
    stop_all
  done
fi
# Latency: one replica without a prefix cache (every random prompt is computed), the router in
# front of it; pairs of requests, one direct and one through the router, back to back in
# alternating order (scripts/bench/paired_ttft.py), so the machine's drift hits both alike.
if [ "${ONLY:-latency}" = latency ]; then
  start_replicas 1 --no-enable-prefix-caching
  for policy in round_robin cache_aware; do
    start_router "$policy" 1
    python3 scripts/bench/paired_ttft.py "http://127.0.0.1:${PORTS[0]}" \
      "http://127.0.0.1:$ROUTER_PORT" --pairs "${PAIRS:-200}" --out "$OUT/latency-$policy.json" |
      sed "s/^/router $policy: /" | tee -a "$OUT/summary.txt"
    kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true
    unset 'PIDS[-1]'
  done
  stop_all
fi
cat "$OUT/summary.txt"
