#!/usr/bin/env bash
# AWQ / GPTQ checkpoints (random weights of a real model's shape, `shape_packed.py`) against
# the GGUF type kiln repacks them into, on the same shape: kiln on the packed directory, kiln
# and llama.cpp on the GGUF file (`shape_gguf.py`'s f16 quantized by `llama-quantize`).
# AWQ, GPTQ with zero points and act-order GPTQ run as Q5_0, symmetric GPTQ as Q4_0. The
# checkpoints keep the token embedding (tied head) in f16, as real ones do; the GGUF files
# hold it quantized, so the packed rows read more bytes per token. Alternates RUNS times,
# medians. Needs `gguf` and `numpy`.
#
#   LLAMA_QUANTIZE=.../llama-quantize LLAMA_BENCH=.../llama-bench \
#   scripts/bench/packed.sh [RUNS] [THREADS]
#
# SHAPE (default "llama-3.2-1b"), METHODS (default "awq gptq gptq-act gptq-sym"), CELLS
# (default "b1 pp512"), TG (default 64) and DIR (default target/shapes) choose what runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS="${1:-3}"
THREADS="${2:-2}"
SHAPE="${SHAPE:-llama-3.2-1b}"
METHODS="${METHODS:-awq gptq gptq-act gptq-sym}"
CELLS="${CELLS:-b1 pp512}"
TG="${TG:-64}"
DIR="${DIR:-${CARGO_TARGET_DIR:-target}/shapes}"
: "${LLAMA_QUANTIZE:?set LLAMA_QUANTIZE to the llama-quantize of llama.cpp}"
mkdir -p "$DIR"
TOKENIZER="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln
KILN="${KILN:-${CARGO_TARGET_DIR:-target}/release/kiln}"
source scripts/bench/cells.sh

f16="$DIR/$SHAPE-f16.gguf"
[[ -s "$f16" ]] || python3 scripts/bench/shape_gguf.py "$SHAPE" "$TOKENIZER" "$f16"
echo "| checkpoint | runs as | cell | kiln, checkpoint | kiln, GGUF | llama.cpp, GGUF | checkpoint / llama.cpp |"
echo "|---|---|---|---:|---:|---:|---:|"
for method in $METHODS; do
  packed="$DIR/$SHAPE-$method"
  [[ -s "$packed/model.safetensors" ]] || python3 scripts/bench/shape_packed.py "$SHAPE" \
    "$method" tests/fixtures/models/llama3/tokenizer.json "$packed" >/dev/null
  ty=Q5_0
  [[ "$method" == gptq-sym ]] && ty=Q4_0
  gguf="$DIR/$SHAPE-${ty,,}.gguf"
  [[ -s "$gguf" ]] || "$LLAMA_QUANTIZE" "$f16" "$gguf" "$ty" "$THREADS" >/dev/null 2>&1
  declare -A P=() K=() L=()
  for run in $(seq "$RUNS"); do
    for cell in $CELLS; do
      P[$cell]+=" $(kiln_cell "$cell" "$packed")"
      K[$cell]+=" $(kiln_cell "$cell" "$gguf")"
      L[$cell]+=" $(llama_cell "$cell" "$gguf")"
    done
  done
  for cell in $CELLS; do
    p="$(echo "${P[$cell]}" | median)"
    k="$(echo "${K[$cell]}" | median)"
    l="$(echo "${L[$cell]}" | median)"
    awk -v m="$method" -v t="$ty" -v c="$cell" -v p="$p" -v k="$k" -v l="$l" 'BEGIN {
      printf "| %s | %s | %s | %.1f | %.1f | %.1f | %.2fx |\n", m, t, c, p, k, l, p / l }'
  done
  unset P K L
done
