#!/usr/bin/env python3
"""transformers' `generate` on a GPU as the baseline of `kiln serve --device cuda`: BATCH prompts
of INPUT random token ids, OUTPUT greedy new tokens each (no early stop), bf16, one call.

Usage: python3 scripts/gpu/hf_batch_generate.py MODEL_DIR [--batch 64] [--input 512] [--output 128]
Prints output tokens per second over the whole call (prefill included, as a server's
throughput is) and the time of the call.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.input), generator=gen).cuda()
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=args.output, min_new_tokens=args.output, do_sample=False,
              attention_mask=mask, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    new = (out.shape[1] - args.input) * args.batch
    print(f"transformers generate: batch {args.batch}, input {args.input}, output {args.output}: "
          f"{secs:.2f} s, {new / secs:.0f} output tokens/s")


if __name__ == "__main__":
    main()
