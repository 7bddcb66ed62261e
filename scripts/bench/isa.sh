#!/usr/bin/env bash
# One kernel path of kiln (`--isa`, default avx2) against llama.cpp built for the same ISA, on
# the default model, alternating RUNS times: prefill 512 and batch-1 decode 128 (`kiln bench
# latency` vs `llama-bench -p 512 -n 128`), and 64 requests of 128 + 128 tokens (`kiln bench
# latency` vs `llama-batched-bench -npp 128 -ntg 128 -npl 64`). KILN_BASE, when set, is a
# previous kiln binary run on its default (best) path, for an A/B of a change to that path (ISA
# must then be the machine's best). Read bandwidth first (`membw`).
#
#   LLAMA_BENCH=.../llama-bench LLAMA_BATCHED=.../llama-batched-bench \
#     scripts/bench/isa.sh [ISA] [RUNS] [THREADS]
set -euo pipefail
cd "$(dirname "$0")/../.."
ISA="${1:-avx2}"
RUNS="${2:-3}"
THREADS="${3:-2}"
MODEL="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln
cargo build --release -q -p kiln-kernels --example membw
KILN="${KILN:-${CARGO_TARGET_DIR:-target}/release/kiln}"
"${CARGO_TARGET_DIR:-target}"/release/examples/membw "$THREADS" 1024
# kiln_cells BINARY [FLAGS...]
kiln_cells() {
  local bin="$1"
  shift
  "$bin" bench latency "$@" --threads "$THREADS" --batch-size 1 --input-len 16 \
    --output-len 128 2>/dev/null | grep '^| 1 '
  "$bin" bench latency "$@" --threads "$THREADS" --batch-size 1 --input-len 512 \
    --output-len 1 2>/dev/null | grep '^| 1 '
  "$bin" bench latency "$@" --threads "$THREADS" --batch-size 64 --input-len 128 \
    --output-len 128 2>/dev/null | grep '^| 64 '
}
for run in $(seq "$RUNS"); do
  echo "== run $run: kiln ($ISA)"
  kiln_cells "$KILN" --isa "$ISA"
  if [[ -n "${KILN_BASE:-}" ]]; then
    echo "== run $run: kiln base (its default path)"
    kiln_cells "$KILN_BASE"
  fi
  if [[ -n "${LLAMA_BENCH:-}" ]]; then
    echo "== run $run: llama.cpp"
    "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r 1 2>/dev/null | grep -E "pp512|tg128"
  fi
  if [[ -n "${LLAMA_BATCHED:-}" ]]; then
    echo "== run $run: llama.cpp batched"
    "$LLAMA_BATCHED" -m "$MODEL" -t "$THREADS" -c 16640 -b 2048 -ub 512 -npp 128 -ntg 128 \
      -npl 64 2>/dev/null | grep -E '^\|\s+128'
  fi
done
