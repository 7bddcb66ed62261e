#!/usr/bin/env bash
# kiln against llama.cpp on random-weight GGUFs of real model shapes: for each shape and type,
# batch-1, batch-4 and batch-16 decode and prefill 512, alternating RUNS times, medians, ratios,
# and batch-1 decode as a share of the measured read bandwidth (`membw`: the weights one token
# reads, of a mixture-of-experts layer only the experts a token routes to, over the time per
# token). The f16 file is written by `shape_gguf.py` (the default model's tokenizer cut to the
# shape's vocabulary) and quantized by `llama-quantize`; both engines read the same quantized
# file. Needs the `gguf` and `numpy` Python packages.
#
#   LLAMA_QUANTIZE=.../llama-quantize LLAMA_BENCH=.../llama-bench \
#   LLAMA_BATCHED=.../llama-batched-bench scripts/bench/shapes.sh [RUNS] [THREADS]
#
# SHAPES (default "llama-3.2-1b"; also "llama-3.1-8b", "qwen3-30b-a3b-12l": Qwen3-30B-A3B's
# mixture-of-experts layers, 12 of its 48, so the file fits a 24 GB machine, and
# "deepseek-v2-lite-6l": DeepSeek-V2-Lite's latent attention and experts, 6 of 27 layers,
# "gpt-oss-20b-6l": gpt-oss-20b's sinks and experts, 6 of 24 layers, with TYPES=MXFP4_MOE),
# TYPES (default
# "Q4_K_M Q5_K_M Q6_K Q8_0"), DIR (where the files go, default target/shapes), KILN (the kiln
# binary), CELLS (default "b1 b4 b16 pp512") and TG (tokens each decode cell generates,
# default 64) choose what runs. The codebook types (IQ1_*, IQ2_*, IQ3_* presets) need an
# importance matrix: LLAMA_IMATRIX (llama.cpp's llama-imatrix) makes one per shape from a
# fixed text.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS="${1:-3}"
THREADS="${2:-2}"
SHAPES="${SHAPES:-llama-3.2-1b}"
TYPES="${TYPES:-Q4_K_M Q5_K_M Q6_K Q8_0}"
CELLS="${CELLS:-b1 b4 b16 pp512}"
TG="${TG:-64}"
DIR="${DIR:-${CARGO_TARGET_DIR:-target}/shapes}"
: "${LLAMA_QUANTIZE:?set LLAMA_QUANTIZE to the llama-quantize of llama.cpp}"
mkdir -p "$DIR"
TOKENIZER="$(cargo run -q --release -p kiln-fetch --example fetch_default_model 2>/dev/null)"
cargo build --release -q -p kiln
cargo build --release -q -p kiln-kernels --example membw
KILN="${KILN:-${CARGO_TARGET_DIR:-target}/release/kiln}"
MEMBW="$("${CARGO_TARGET_DIR:-target}"/release/examples/membw "$THREADS" 1024)"
echo "$MEMBW"
GBS="$(echo "$MEMBW" | sed -E 's/.*: ([0-9.]+) GB\/s.*/\1/')"

source scripts/bench/cells.sh
# read_bytes FILE: the bytes one decoded token reads: every tensor but an untied token
# embedding, and of a mixture-of-experts layer's stacked `*_exps` tensors only the share of the
# experts one token uses (`expert_used_count / expert_count`).
read_bytes() {
  python3 - "$1" <<'PY'
import sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
def meta(suffix):
    for key, field in r.fields.items():
        if key.endswith(suffix):
            return int(field.parts[field.data[0]][0])
    return None
experts, used = meta(".expert_count"), meta(".expert_used_count")
names = {t.name for t in r.tensors}
untied = "output.weight" in names
total = 0
for t in r.tensors:
    if untied and t.name == "token_embd.weight":
        continue
    share = used / experts if experts and "_exps." in t.name else 1
    total += int(t.n_bytes) * share
print(int(total))
PY
}

# imatrix_args TYPE F16: llama-quantize's `--imatrix FILE` for the types that need one.
imatrix_args() {
  case "$1" in IQ1_* | IQ2_* | IQ3_*) ;; *) return 0 ;; esac
  : "${LLAMA_IMATRIX:?set LLAMA_IMATRIX to llama-imatrix (the IQ1-IQ3 presets need an imatrix)}"
  local im="${2%.gguf}-imatrix.gguf"
  if [[ ! -s "$im" ]]; then
    python3 scripts/fixtures/imatrix_text.py >"$im.txt"
    "$LLAMA_IMATRIX" -m "$2" -f "$im.txt" -o "$im" -c 128 --chunks 8 -t "$THREADS" >/dev/null 2>&1
  fi
  echo "--imatrix $im"
}

for shape in $SHAPES; do
  f16="$DIR/$shape-f16.gguf"
  [[ -s "$f16" ]] || python3 scripts/bench/shape_gguf.py "$shape" "$TOKENIZER" "$f16"
  for ty in $TYPES; do
    file="$DIR/$shape-${ty,,}.gguf"
    # shellcheck disable=SC2046 # the imatrix arguments are two words or none
    [[ -s "$file" ]] || "$LLAMA_QUANTIZE" $(imatrix_args "$ty" "$f16") "$f16" "$file" "$ty" \
      "$THREADS" >/dev/null 2>&1
    read_bytes="$(read_bytes "$file")"
    declare -A K=() L=()
    for run in $(seq "$RUNS"); do
      for cell in $CELLS; do
        K[$cell]+=" $(kiln_cell "$cell" "$file")"
        L[$cell]+=" $(llama_cell "$cell" "$file")"
      done
    done
    echo
    mib=$((read_bytes / 1048576))
    echo "### $shape $ty: $mib MiB read per token, $RUNS runs, medians"
    echo
    echo "| cell | kiln tok/s | llama.cpp tok/s | kiln / llama.cpp | batch-1 share of ${GBS} GB/s |"
    echo "|---|---:|---:|---:|---:|"
    for cell in $CELLS; do
      k="$(echo "${K[$cell]}" | median)"
      l="$(echo "${L[$cell]}" | median)"
      awk -v c="$cell" -v k="$k" -v l="$l" -v b="$read_bytes" -v g="$GBS" 'BEGIN {
        share = (c == "b1") ? sprintf("%.0f %% (llama.cpp %.0f %%)", 100 * k * b / (g * 1e9),
          100 * l * b / (g * 1e9)) : ""
        printf "| %s | %.1f | %.1f | %.2fx | %s |\n", c, k, l, k / l, share }'
    done
    unset K L
  done
done
