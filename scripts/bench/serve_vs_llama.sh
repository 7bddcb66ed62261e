#!/usr/bin/env bash
# Online serving, kiln vs llama.cpp's llama-server, with the same `kiln bench serve` command:
# 64 requests of ~220 random-text tokens, 128 output tokens (EOS ignored), at concurrency 1, 4
# and 16; then 32 requests sharing a 1,000-token prefix (+220 own tokens, 32 output tokens) at
# concurrency 4. Each server runs alone on the machine, 2 threads, default model.
#
#   LLAMA_SERVER=/path/to/llama-server scripts/bench/serve_vs_llama.sh [OUT_DIR]
# (SKIP_KILN=1 runs only llama-server; KILN_ARGS adds flags to `kiln serve`, e.g.
# KILN_ARGS="--profile latency" or "--isa avx2"; CONCURRENCIES="16" runs only those levels and
# SKIP_PREFIX=1 skips the shared-prefix run.)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-bench-results}"
mkdir -p "$OUT"
MODEL="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln
KILN="${CARGO_TARGET_DIR:-target}/release/kiln"
PORT=8090

wait_ready() {
  for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "server did not start" >&2
  return 1
}

run_suite() {
  local name="$1"
  for c in ${CONCURRENCIES:-1 4 16}; do
    "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m \
      --num-prompts 64 --input-len 220 --output-len 128 --ignore-eos --max-concurrency "$c" \
      --seed "$c" --label "$name c=$c" --save-result "$OUT/$name-c$c.json" | tee "$OUT/$name-c$c.txt"
  done
  if [[ -n "${SKIP_PREFIX:-}" ]]; then return 0; fi
  "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m \
    --dataset prefix-repetition --prefix-len 1000 --input-len 220 --num-prefixes 1 \
    --num-prompts 32 --output-len 32 --ignore-eos --max-concurrency 4 --seed 7 \
    --label "$name prefix c=4" --save-result "$OUT/$name-prefix.json" | tee "$OUT/$name-prefix.txt"
}

if [[ -z "${SKIP_KILN:-}" ]]; then
  "$KILN" serve --model "$MODEL" --served-model-name gemma-3-270m --port "$PORT" --threads 2 \
    --disable-log-requests ${KILN_ARGS:-} 2>"$OUT/kiln-server.log" &
  KILN_PID=$!
  trap 'kill $KILN_PID 2>/dev/null || true' EXIT
  wait_ready
  run_suite kiln
  kill "$KILN_PID"; wait "$KILN_PID" 2>/dev/null || true
fi

if [[ -n "${LLAMA_SERVER:-}" ]]; then
  "$LLAMA_SERVER" -m "$MODEL" -t 2 -np 16 -c 32768 -cb --host 127.0.0.1 --port "$PORT" \
    --no-webui --metrics 2>"$OUT/llama-server.log" &
  LLAMA_PID=$!
  trap 'kill $LLAMA_PID 2>/dev/null || true' EXIT
  wait_ready
  run_suite llama-server
  kill "$LLAMA_PID"; wait "$LLAMA_PID" 2>/dev/null || true
fi
