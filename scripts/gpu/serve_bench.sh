#!/usr/bin/env bash
# `kiln serve --device cuda` under `kiln bench serve` at concurrency 64 (random prompts of 512
# tokens, 128 output tokens, 256 requests), with CUDA graphs (the default) and again with
# --enforce-eager (EAGER=0 skips it), then transformers' `generate` on the same model and GPU
# at batch 64 as the baseline (HF_BASELINE=0 skips it).
# Usage: scripts/gpu/serve_bench.sh KILN_BINARY MODEL_DIR
set -uo pipefail
kiln="$1" model="$2" port="${PORT:-8123}"
status=0

# One server run: its start-up lines, then the bench's table.
serve_once() {
    echo "--- kiln serve $*"
    "$kiln" serve "$model" --device cuda --port "$port" --max-num-seqs 64 --max-model-len 2048 \
        --max-num-batched-tokens 8192 "$@" > /tmp/kiln-serve.log 2>&1 &
    local pid=$!
    for _ in $(seq 1 240); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        kill -0 $pid 2> /dev/null || break
        sleep 0.5
    done
    grep -E "CUDA|GPU memory|KV cache" /tmp/kiln-serve.log
    if ! curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
        echo "kiln serve did not start:"; tail -20 /tmp/kiln-serve.log; status=1; return
    fi
    "$kiln" bench serve --port "$port" --tokenizer "$model" --dataset random --input-len 512 \
        --output-len 128 --num-prompts 256 --max-concurrency 64 || status=1
    kill -TERM $pid; wait $pid
}

serve_once
[ "${EAGER:-1}" = 1 ] && serve_once --enforce-eager
if [ "${HF_BASELINE:-1}" = 1 ]; then
    python3 "$(dirname "$0")/hf_batch_generate.py" "$model" --batch 64 --input 512 --output 128 ||
        status=1
fi
exit $status
