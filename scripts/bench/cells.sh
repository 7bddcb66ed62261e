# The benchmark cells shared by shapes.sh and packed.sh (sourced; needs KILN, THREADS, TG
# and, for llama.cpp, LLAMA_BENCH / LLAMA_BATCHED): each prints one number, tok/s.
# Cells: b1, b4, b16 (decode at that batch, prompts of 16 tokens, TG tokens each) and pp512.

# kiln_cell CELL FILE: one number (tok/s).
kiln_cell() {
  local args=(bench latency --model "$2" --threads "$THREADS")
  case "$1" in
    pp512) "$KILN" "${args[@]}" --batch-size 1 --input-len 512 --output-len 1 2>/dev/null |
      awk -F'|' '$2 ~ /^ *1 *$/ {gsub(/ /, "", $6); print $6}' ;;
    b*) "$KILN" "${args[@]}" --batch-size "${1#b}" --input-len 16 --output-len "$TG" 2>/dev/null |
      awk -F'|' -v b="${1#b}" '$2 ~ "^ *" b " *$" {gsub(/ /, "", $8); print $8}' ;;
  esac
}
# llama_cell CELL FILE: the same cell with llama.cpp.
llama_cell() {
  case "$1" in
    pp512) "${LLAMA_BENCH:?}" -m "$2" -t "$THREADS" -p 512 -n 0 -r 1 2>/dev/null |
      awk -F'|' '/pp512/ {split($8, v, " "); print v[1]}' ;;
    b1) "${LLAMA_BENCH:?}" -m "$2" -t "$THREADS" -p 0 -n "$TG" -r 1 2>/dev/null |
      awk -F'|' -v tg="tg$TG" '$0 ~ tg {split($8, v, " "); print v[1]}' ;;
    b*) "${LLAMA_BATCHED:?}" -m "$2" -t "$THREADS" -c 4096 -b 512 -ub 512 -npp 16 -ntg "$TG" \
      -npl "${1#b}" 2>/dev/null | awk -F'|' '$2 ~ /^ *16 *$/ {gsub(/ /, "", $9); print $9}' ;;
  esac
}
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
