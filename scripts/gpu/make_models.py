#!/usr/bin/env python3
"""Random-weight bf16 models of real shapes, and transformers' reference outputs, on a GPU.

For each shape (Qwen2.5-0.5B, Llama-3.2-1B) this writes a Hugging Face model directory
(``save_pretrained``, bf16 safetensors, the tokenizer of the matching tiny fixture) plus:

* ``reference_logits.safetensors``: f32 logits ``case{i}`` ``[prompt + 64, vocab]`` of eight
  prompts followed by their greedy continuation, from the same weights run in **f32** on the
  GPU (the higher-precision reference);
* ``reference.json``: the prompts' ids, the f32 model's 64 greedy ids, and the yardstick: how
  far transformers' own **bf16** run is from the f32 one (relative L2 error of each logits row,
  greedy agreement), which bounds what "within bf16 tolerance" can mean.

``--bench DIR`` also writes a Llama-3.1-8B-shaped model (no reference) for the speed runs.

Usage: ``python3 scripts/gpu/make_models.py OUT_DIR [--bench]`` (needs torch with CUDA and
transformers; nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "models"
NUM_PROMPTS = 8
NEW_TOKENS = 64

SHAPES = {
    # Qwen/Qwen2.5-0.5B's config.json (tied embeddings, q/k/v bias).
    "qwen2.5-0.5b": (Qwen2ForCausalLM, Qwen2Config, "qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, eos_token_id=151643, bos_token_id=151643)),
    # meta-llama/Llama-3.2-1B's config.json (Llama 3 RoPE scaling, tied embeddings).
    "llama3.2-1b": (LlamaForCausalLM, LlamaConfig, "llama3", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=128001)),
}

BENCH = ("llama3.1-8b", (LlamaForCausalLM, LlamaConfig, "llama3", dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=128001)))


def build(name: str, spec, out: Path, seed: int) -> torch.nn.Module:
    model_cls, config_cls, tokenizer_of, kwargs = spec
    # The tokenizer is the tiny fixture's: its special tokens are the model's.
    fixture = json.loads((FIXTURES / tokenizer_of / "config.json").read_text())
    kwargs = dict(kwargs, bos_token_id=fixture.get("bos_token_id"),
                  eos_token_id=fixture.get("eos_token_id"))
    config = config_cls(**kwargs, initializer_range=0.02)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16)
    with torch.no_grad():  # our own draw, not transformers' init: every matrix N(0, 0.02)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device="cuda")
            if p.dim() >= 2:
                p.copy_(noise * 0.02)
            elif "norm" in pname:  # norm weights around 1
                p.copy_(1.0 + 0.1 * noise)
            else:  # biases
                p.copy_(0.02 * noise)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / tokenizer_of / f, out / f)
    return model


@torch.no_grad()
def greedy(model, prompt: torch.Tensor) -> list[int]:
    out = model(prompt[None], use_cache=True)
    cache, ids = out.past_key_values, []
    nxt = out.logits[0, -1].float().argmax().item()
    for _ in range(NEW_TOKENS):
        ids.append(nxt)
        out = model(torch.tensor([[nxt]], device="cuda"), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[0, -1].float().argmax().item()
    return ids


def rel_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


@torch.no_grad()
def reference(model_bf16, out: Path, seed: int) -> dict:
    model_f32 = type(model_bf16)(model_bf16.config).to("cuda")
    model_f32.load_state_dict({k: v.float() for k, v in model_bf16.state_dict().items()})
    model_f32 = model_f32.float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = model_bf16.config.vocab_size
    cases, tensors, bf16_errs, agree, forced, rows = [], {}, [], 0, 0, 0
    for i in range(NUM_PROMPTS):
        length = int(torch.randint(8, 40, (1,), generator=gen))
        prompt = torch.randint(0, vocab, (length,), generator=gen).cuda()
        ids32 = greedy(model_f32, prompt)
        ids16 = greedy(model_bf16, prompt)
        agree += sum(int(a == b) for a, b in zip(ids32, ids16))
        full = torch.cat([prompt, torch.tensor(ids32, device="cuda")])
        logits32 = model_f32(full[None]).logits[0].float()
        logits16 = model_bf16(full[None]).logits[0].float()
        bf16_errs.append(rel_rows(logits16, logits32).max().item())
        forced += (logits16.argmax(-1) == logits32.argmax(-1)).sum().item()
        rows += logits32.shape[0]
        tensors[f"case{i}"] = logits32.cpu().contiguous()
        cases.append(dict(prompt_ids=prompt.tolist(), greedy_ids=ids32, logits_tensor=f"case{i}"))
    save_file(tensors, str(out / "reference_logits.safetensors"))
    yardstick = dict(
        transformers_bf16_max_row_rel_err=max(bf16_errs),
        transformers_bf16_greedy_agreement=agree / (NUM_PROMPTS * NEW_TOKENS),
        transformers_bf16_argmax_agreement=forced / rows,
    )
    (out / "reference.json").write_text(json.dumps(dict(cases=cases, yardstick=yardstick)))
    del model_f32
    torch.cuda.empty_cache()
    return yardstick


@torch.no_grad()
def tiny_yardstick(out: Path) -> dict:
    """transformers' bf16 run of each tiny fixture against the committed f32 logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = {}
    for name in ("llama3", "llama2", "mistral", "qwen2", "qwen3", "gemma3"):
        d = FIXTURES / name
        ref = json.loads((d / "reference.json").read_text())
        want = load_file(str(d / "reference_logits.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
        worst, same, rows = 0.0, 0, 0
        for c in ref["cases"]:
            ids = torch.tensor([c["prompt_ids"] + c["greedy_ids"]], device="cuda")
            got = model(ids).logits[0].float().cpu()
            w = want[c["logits_tensor"]].float()
            worst = max(worst, rel_rows(got, w).max().item())
            same += (got.argmax(-1) == w.argmax(-1)).sum().item()
            rows += w.shape[0]
        result[name] = dict(max_row_rel_err=worst, argmax_agreement=same / rows)
        print(f"tiny {name}: transformers bf16 vs f32 {result[name]}", flush=True)
    (out / "tiny_yardstick.json").write_text(json.dumps(result))
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--bench", action="store_true", help="also the Llama-3.1-8B-shaped model")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tiny_yardstick(args.out)
    for seed, (name, spec) in enumerate(SHAPES.items()):
        model = build(name, spec, args.out / name, seed)
        print(f"{name}: {reference(model, args.out / name, seed)}", flush=True)
        del model
        torch.cuda.empty_cache()
    if args.bench:
        name, spec = BENCH
        model = build(name, spec, args.out / name, 99)
        del model
        torch.cuda.empty_cache()
        print(f"{name}: written", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
