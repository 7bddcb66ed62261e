"""Prefill and decode speed of Hugging Face transformers on a model directory, for side-by-side
comparison with `kiln generate` (same prompt text, greedy, fixed output length).

    python scripts/bench/hf_generate_baseline.py MODEL_DIR --threads 2 --max-tokens 128 \
        --prompt "$(python3 -c "print('The quick brown fox jumps over the lazy dog. ' * 21)")"

Needs the fixture venv (scripts/fixtures/requirements.txt). Prints one line in kiln's format.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    ids = tok(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        for _ in range(args.max_tokens - 1):
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
    n = ids.shape[1]
    print(
        f"prompt: {n} tokens, {n / (t1 - t0):.1f} tok/s | output: {args.max_tokens} tokens, "
        f"{(args.max_tokens - 1) / (t2 - t1):.1f} tok/s (decode, {args.threads} threads, {args.dtype})"
    )


if __name__ == "__main__":
    main()
