#!/usr/bin/env bash
# Embedding throughput, kiln vs llama.cpp's llama-server --embedding, on the same GGUF of an
# embedding model (a decoder or a BERT encoder), with the same `kiln bench serve --backend openai-embeddings`
# command: NUM inputs of 128 random-text tokens each, one input per /v1/embeddings request, at
# concurrency 1 and 16; the servers alternate RUNS times, each alone on the machine, 2 threads.
#
#   LLAMA_SERVER=/path/to/llama-server scripts/bench/embeddings.sh MODEL.gguf [RUNS] [OUT_DIR]
#
# MODEL.gguf: e.g. `scripts/bench/shape_gguf.py qwen3-embedding-0.6b ...` (Qwen3-Embedding-0.6B's
# shape, last-token pooling) or `scripts/bench/encoder_shape_gguf.py bge-small ...` (a BERT
# encoder, CLS pooling), quantized by llama-quantize. Prints inputs/s per server and run.
# (NUM=256 inputs per run; CONCURRENCIES="1 16". Every run and level sends other texts, so no
# input is ever served from a prefix cache.)
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL="$1"
RUNS="${2:-3}"
OUT="${3:-bench-results/embeddings}"
mkdir -p "$OUT"
cargo build --release -q -p kiln
KILN="${CARGO_TARGET_DIR:-target}/release/kiln"
PORT=8091
: "${LLAMA_SERVER:?set LLAMA_SERVER to the llama-server binary}"

wait_ready() {
  for _ in $(seq 1500); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    if ! kill -0 "$1" 2>/dev/null; then echo "the server exited" >&2; return 1; fi
    sleep 0.2
  done
  echo "server did not start" >&2
  return 1
}

measure() {
  local name="$1" run="$2"
  for c in ${CONCURRENCIES:-1 16}; do
    "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model embed \
      --backend openai-embeddings --tokenizer "$MODEL" --num-prompts "${NUM:-256}" \
      --input-len 128 --max-concurrency "$c" --seed "$((run * 100 + c))" --label "$name c=$c" \
      --percentile-metrics e2el --save-result "$OUT/$name-c$c-run$run.json" \
      >"$OUT/$name-c$c-run$run.txt"
    local file="$OUT/$name-c$c-run$run.txt" rate latency
    rate="$(grep 'Request throughput' "$file" | awk '{print $NF}')"
    latency="$(grep 'Mean E2EL' "$file" | awk '{print $NF}')"
    printf '%-13s run %s c=%-3s %8.1f inputs/s  mean latency %s ms\n' \
      "$name" "$run" "$c" "$rate" "$latency"
  done
}

for run in $(seq "$RUNS"); do
  "$KILN" serve "$MODEL" --runner pooling --served-model-name embed --port "$PORT" --threads 2 \
    --disable-log-requests ${KILN_ARGS:-} 2>"$OUT/kiln-server.log" &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  wait_ready "$pid"
  measure kiln "$run"
  kill "$pid"; wait "$pid" 2>/dev/null || true

  "$LLAMA_SERVER" -m "$MODEL" --embedding -a embed -t 2 -np 16 -c 4096 -b 2048 -ub 2048 \
    --host 127.0.0.1 --port "$PORT" --no-webui 2>"$OUT/llama-server.log" &
  pid=$!
  wait_ready "$pid"
  measure llama-server "$run"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
