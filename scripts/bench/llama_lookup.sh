#!/usr/bin/env bash
# llama.cpp's own lookup decoding (`llama-lookup`, prompt n-grams) over a JSON-lines prompt file,
# greedy, EOS ignored, one prompt at a time; prints the summed decode tok/s and acceptance, for
# comparison with `kiln bench speculative` on the same file.
#
#   LLAMA_LOOKUP=/path/to/llama-lookup scripts/bench/llama_lookup.sh MODEL.gguf PROMPTS.jsonl \
#     [N_PREDICT=256] [DRAFT_MAX=5] [THREADS=2]
set -euo pipefail
MODEL="$1"; PROMPTS="$2"; N="${3:-256}"; DRAFT="${4:-5}"; THREADS="${5:-2}"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
i=0
while IFS= read -r line; do
  [ -z "$line" ] && continue
  python3 -c 'import json,sys; sys.stdout.write(json.loads(sys.argv[1])["prompt"])' "$line" >"$TMP/p.txt"
  "$LLAMA_LOOKUP" -m "$MODEL" -f "$TMP/p.txt" -n "$N" -t "$THREADS" --spec-draft-n-max "$DRAFT" \
    --temp 0 --ignore-eos -c 4096 --seed 0 >"$TMP/out-$i.txt" 2>&1 || { cat "$TMP/out-$i.txt"; exit 1; }
  i=$((i + 1))
done <"$PROMPTS"
cat "$TMP"/out-*.txt | python3 -c '
import re, sys
text = sys.stdin.read()
dec = re.findall(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
drafted = sum(int(x) for x in re.findall(r"n_drafted\s+=\s+(\d+)", text))
accepted = sum(int(x) for x in re.findall(r"n_accept\s+=\s+(\d+)", text))
tokens = sum(int(n) for n, _ in dec); secs = sum(float(s) for _, s in dec)
print(f"llama-lookup: {len(dec)} prompts, {tokens} tokens in {secs:.3f} s: {tokens / secs:.1f} tok/s; "
      f"{drafted} drafted, {accepted} accepted ({100 * accepted / max(drafted, 1):.1f} %)")
'
