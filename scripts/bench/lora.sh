#!/usr/bin/env bash
# LoRA serving cost: one `kiln serve` of the default model with 4 random rank-16 adapters
# (scripts/bench/random_lora.py), then `kiln bench serve` at concurrency 16 alternately on the
# base model and spread over the 4 adapters, ROUNDS times, on the same server. Prefix caching is
# off: the runs repeat their prompts, so later rounds would hit the cache. Extra server flags
# (e.g. `--lora-dtype float32`) come from $KILN_FLAGS.
#   scripts/bench/lora.sh KILN_BINARY [ROUNDS] [OUT_DIR]
# Prints per run: label, output tok/s, p95 TTFT ms; then the medians and their ratio.
set -euo pipefail
KILN="$1"; ROUNDS="${2:-3}"; OUT="${3:-$(mktemp -d)}"
PORT="${PORT:-8123}"
mkdir -p "$OUT"
here="$(dirname "$0")"
modules=()
for i in 1 2 3 4; do
  [ -f "$OUT/a$i/adapter_model.safetensors" ] || python3 "$here/random_lora.py" "$OUT/a$i" --seed "$i" >/dev/null
  modules+=("a$i=$OUT/a$i")
done
# shellcheck disable=SC2086 # KILN_FLAGS splits into flags
"$KILN" serve --threads 2 --port "$PORT" --served-model-name gemma-3-270m --disable-log-requests \
  --no-enable-prefix-caching --enable-lora --lora-modules "${modules[@]}" ${KILN_FLAGS:-} \
  2>"$OUT/server.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
# Up to 20 minutes for the model to load (a float file quantized as it loads takes minutes).
for _ in $(seq 6000); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$pid" 2>/dev/null || { echo "the server exited; see $OUT/server.log" >&2; exit 1; }
  sleep 0.2
done
run() { # label extra-flags
  # shellcheck disable=SC2086
  "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m --num-prompts 64 \
    --input-len 220 --output-len 128 --ignore-eos --max-concurrency 16 --seed 16 \
    --percentile-metrics ttft,tpot,itl --metric-percentiles 50,95 $2 \
    --save-result "$OUT/$1.json" >"$OUT/$1.txt" 2>&1
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%s\t%.1f\t%.0f" % (sys.argv[2], r["output_throughput"], r["p95_ttft_ms"]))' "$OUT/$1.json" "$1"
}
for round in $(seq "$ROUNDS"); do
  run "base-$round" ""
  run "lora-$round" "--lora-modules a1 a2 a3 a4"
done | tee "$OUT/runs.tsv"
python3 - "$OUT/runs.tsv" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]) if l.strip()]
med = lambda k: statistics.median(float(r[1]) for r in rows if r[0].startswith(k))
b, l = med("base"), med("lora")
print(f"median output tok/s: base {b:.1f}, 4 adapters {l:.1f}, ratio {l / b:.2f}")
PY
