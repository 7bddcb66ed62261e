#!/usr/bin/env bash
# Prefill (512 tokens) and batch-1 decode (128 tokens) of the default model, kiln and, when
# LLAMA_BENCH points at llama.cpp's llama-bench, llama.cpp, alternating RUNS times.
#
#   scripts/bench/default_model.sh [RUNS] [THREADS]
#   LLAMA_BENCH=/path/to/llama-bench scripts/bench/default_model.sh 3 2
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS="${1:-3}"
THREADS="${2:-2}"
MODEL="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln-models --example forward_bench
cargo build --release -q -p kiln-kernels --example membw
"${CARGO_TARGET_DIR:-target}"/release/examples/membw "$THREADS" 1024
for run in $(seq "$RUNS"); do
  echo "== run $run: kiln"
  "${CARGO_TARGET_DIR:-target}"/release/examples/forward_bench "$MODEL" 512 128 "$THREADS" 2>/dev/null
  if [[ -n "${LLAMA_BENCH:-}" ]]; then
    echo "== run $run: llama.cpp"
    "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r 1 2>/dev/null | grep -E "pp512|tg128"
  fi
done
