#!/usr/bin/env bash
# A/B of two kiln binaries on the default model, alternating (A B A B ...) so that machine
# noise hits both alike: prefill of 512 tokens, batch-1 decode, batch-64 decode (all `kiln
# bench latency`, in process) and serving at concurrency 16 (`kiln bench serve` against
# `kiln serve`). Prints one line per run and the medians; keeps raw output in OUT_DIR.
#
#   scripts/bench/ab.sh OLD_KILN NEW_KILN [ROUNDS=3] [OUT_DIR=bench-ab]
# (SKIP_SERVE=1 leaves out the serving run; OLD_ARGS / NEW_ARGS add engine flags to one side's
# runs, to A/B a flag on one binary: `NEW_ARGS=--async-scheduling scripts/bench/ab.sh K K`.)
set -euo pipefail
OLD="$1"; NEW="$2"; ROUNDS="${3:-3}"; OUT="${4:-bench-ab}"
mkdir -p "$OUT"
PORT=8097
: > "$OUT/runs.tsv"

# `kiln bench latency` prints a markdown row `| B | PP | TG | T_PP | S_PP | T_TG | S_TG | ...`
# and, on stderr, `decode step ... host H ms`: prints S_PP, S_TG and H.
latency() { # binary label extra-flags args...
  local bin="$1" label="$2" extra="$3"; shift 3
  # shellcheck disable=SC2086 # the extra flags split into words
  "$bin" bench latency --threads 2 $extra "$@" 2>&1 | tee -a "$OUT/$label.txt" | awk '
    /^\| *[0-9]/ { split($0, f, "|"); gsub(/ /, "", f[6]); gsub(/ /, "", f[8])
                   pp = f[6]; tg = f[8] }
    /decode step/ { for (i = 1; i <= NF; i++) if ($i == "host") host = $(i + 1) }
    END { print pp "\t" tg "\t" host }'
}

serve() { # binary label extra-flags
  local bin="$1" label="$2" extra="$3"
  # shellcheck disable=SC2086
  "$bin" serve --threads 2 --port "$PORT" --served-model-name gemma-3-270m $extra \
    --disable-log-requests 2>"$OUT/$label-server.log" &
  local pid=$!
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done
  "$NEW" bench serve --base-url "http://127.0.0.1:$PORT" --model gemma-3-270m --num-prompts 64 \
    --input-len 220 --output-len 128 --ignore-eos --max-concurrency 16 --seed 16 \
    --percentile-metrics ttft,tpot,itl --metric-percentiles 50,95 \
    --save-result "$OUT/$label-serve.json" >"$OUT/$label-serve.txt" 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("%.1f\t%.0f" % (r["output_throughput"], r["p95_ttft_ms"]))' "$OUT/$label-serve.json"
}

for round in $(seq "$ROUNDS"); do
  for side in old new; do
    bin="$OLD"; args="${OLD_ARGS:-}"
    [[ $side == new ]] && bin="$NEW" && args="${NEW_ARGS:-}"
    tag="$side-$round"
    prefill=$(latency "$bin" "$tag-prefill" "$args" --batch-size 1 --input-len 512 --output-len 2 |
      cut -f1)
    b1=$(latency "$bin" "$tag-b1" "$args" --batch-size 1 --input-len 128 --output-len 128)
    b64=$(latency "$bin" "$tag-b64" "$args" --batch-size 64 --input-len 128 --output-len 128)
    serve_tps=0; ttft95=0
    [[ -z "${SKIP_SERVE:-}" ]] && read -r serve_tps ttft95 <<<"$(serve "$bin" "$tag" "$args")"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$side" "$round" "$prefill" \
      "$(cut -f2 <<<"$b1")" "$(cut -f2 <<<"$b64")" "$serve_tps" "$ttft95" \
      "$(cut -f3 <<<"$b1")" "$(cut -f3 <<<"$b64")" | tee -a "$OUT/runs.tsv"
  done
done

python3 - "$OUT/runs.tsv" <<'PY'
import statistics, sys
rows = [l.split("\t") for l in open(sys.argv[1]) if l.strip()]
names = ["prefill 512 tok/s", "decode B=1 tok/s", "decode B=64 tok/s", "c=16 output tok/s",
         "c=16 TTFT p95 ms", "decode B=1 host ms/step", "decode B=64 host ms/step"]
print("| metric | old runs | new runs | old median | new median | new/old |")
print("|---|---|---|---:|---:|---:|")
for i, name in enumerate(names):
    vals = {s: [float(r[2 + i]) for r in rows if r[0] == s] for s in ("old", "new")}
    if not any(vals["old"]):
        continue
    mo, mn = statistics.median(vals["old"]), statistics.median(vals["new"])
    d = 3 if "host" in name else 0
    fmt = lambda v: " / ".join(f"{x:,.{d}f}" for x in v)
    print(f"| {name} | {fmt(vals['old'])} | {fmt(vals['new'])} | {mo:,.{d}f} | {mn:,.{d}f} "
          f"| {mn/mo:.3f} |")
PY
