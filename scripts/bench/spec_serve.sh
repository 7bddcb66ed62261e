#!/usr/bin/env bash
# Serving at concurrency 16 with speculative decoding off and on (`kiln bench serve` against
# `kiln serve` on loopback, the default model, 2 threads), alternating, ROUNDS times each.
# Prints output tok/s and p99 TTFT per run; raw output in OUT_DIR. MODEL=PATH serves another
# target than the default model (e.g. its F16 copy, with the default model as the draft).
#
#   [MODEL=PATH] scripts/bench/spec_serve.sh KILN [ROUNDS=2] [OUT_DIR=bench-spec-serve] [SPEC_JSON]
set -euo pipefail
KILN="$1"; ROUNDS="${2:-2}"; OUT="${3:-bench-spec-serve}"
SPEC="${4:-{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5\}}"
mkdir -p "$OUT"
PORT=8098

run() { # label [serve args...]
  local label="$1"; shift
  "$KILN" serve ${MODEL:+--model "$MODEL"} --threads 2 --port "$PORT" \
    --served-model-name gemma-3-270m --disable-log-requests "$@" 2>"$OUT/$label-server.log" &
  local pid=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done
  "$KILN" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m --num-prompts 64 \
    --input-len 220 --output-len 128 --ignore-eos --max-concurrency 16 --seed 16 \
    --save-result "$OUT/$label.json" >"$OUT/$label.txt" 2>&1
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^kiln:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total' \
    >"$OUT/$label-spec.txt" || true
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%s\t%.1f tok/s\tp99 TTFT %.0f ms" % (sys.argv[2], r["output_throughput"], r["p99_ttft_ms"]))' \
    "$OUT/$label.json" "$label"
}

for r in $(seq "$ROUNDS"); do
  if (( r % 2 )); then
    run "off-$r"; run "on-$r" --speculative-config "$SPEC"
  else
    run "on-$r" --speculative-config "$SPEC"; run "off-$r"
  fi
done
