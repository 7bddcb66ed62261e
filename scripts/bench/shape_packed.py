#!/usr/bin/env python3
"""Writes a random-weight AWQ or GPTQ checkpoint (a Hugging Face directory) with the tensor
shapes of a real model, for speed measurements of kiln's packed-checkpoint path.

    python3 scripts/bench/shape_packed.py SHAPE METHOD TOKENIZER_JSON OUT_DIR

SHAPE is a dense shape of `shape_gguf.py` (`llama-3.2-1b`, `llama-3.1-8b`). METHOD is `awq`
(AutoAWQ's `gemm` layout, 4-bit, group 128, zero points), `gptq` (4-bit, group 128, zero
points, `desc_act` false), `gptq-sym` (4-bit, group 128, symmetric) or `gptq-act` (as `gptq`
with `desc_act` true: a random act order per input, shared by the matrices that read it, as
GPTQ gives q/k/v and gate/up). The packed integers are uniform random bits, zero points and
scales random in a realistic range; embeddings and norms are f16 / ones, the head tied as in
the shape. TOKENIZER_JSON is any `tokenizer.json` (the llama3 test fixture's is fine: the
benchmark's prompts are random ids). The tensors are generated one at a time from a fixed
seed, so the directory is the same on every run. Needs only `numpy`.
"""

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shape_gguf import SHAPES  # noqa: E402

GROUP = 128


def projections(hidden, inter, heads, kv_heads, head_dim):
    """(name, out, in, input key) per projection of a layer; the key groups matrices that
    read one input."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        ("self_attn.q_proj", q, hidden, "attn"),
        ("self_attn.k_proj", kv, hidden, "attn"),
        ("self_attn.v_proj", kv, hidden, "attn"),
        ("self_attn.o_proj", hidden, q, "o"),
        ("mlp.gate_proj", inter, hidden, "mlp"),
        ("mlp.up_proj", inter, hidden, "mlp"),
        ("mlp.down_proj", hidden, inter, "down"),
    ]


def packed(method, out, inp, rng, order):
    """The tensors (suffix, dtype, shape, array thunk) of one packed matrix."""
    groups = inp // GROUP
    sym = method == "gptq-sym"

    def zeros_words(cols_per_word_axis):
        if sym:  # stored 7 (+1 = 8), eight per word
            return np.full(cols_per_word_axis, 0x77777777, dtype=np.uint32).view(np.int32)
        return rng.integers(0, 2**32, size=cols_per_word_axis, dtype=np.uint32).view(np.int32)

    scales = lambda: (rng.random((groups, out), dtype=np.float32) * 0.004 + 0.001).astype(np.float16)
    bits = lambda shape: rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(np.int32)
    if method == "awq":
        return [
            ("qweight", "I32", (inp, out // 8), lambda: bits((inp, out // 8))),
            ("qzeros", "I32", (groups, out // 8), lambda: zeros_words((groups, out // 8))),
            ("scales", "F16", (groups, out), scales),
        ]
    g_idx = np.arange(inp, dtype=np.int32) // GROUP
    if order is not None:
        g_idx = np.empty(inp, dtype=np.int32)
        g_idx[order] = np.arange(inp, dtype=np.int32) // GROUP
    return [
        ("qweight", "I32", (inp // 8, out), lambda: bits((inp // 8, out))),
        ("qzeros", "I32", (groups, out // 8), lambda: zeros_words((groups, out // 8))),
        ("scales", "F16", (groups, out), scales),
        ("g_idx", "I32", (inp,), lambda: g_idx),
    ]


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    shape, method, tokenizer, out_dir = sys.argv[1:]
    if method not in ("awq", "gptq", "gptq-sym", "gptq-act"):
        sys.exit(f"unknown method {method}")
    hidden, inter, layers, heads, kv_heads, vocab, tied, theta = SHAPES[shape]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    f16_normal = lambda shape: (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
    ones = lambda n: lambda: np.ones(n, dtype=np.float16)
    tensors = [("model.embed_tokens.weight", "F16", (vocab, hidden), lambda: f16_normal((vocab, hidden)))]
    for l in range(layers):
        p = f"model.layers.{l}."
        tensors.append((p + "input_layernorm.weight", "F16", (hidden,), ones(hidden)))
        tensors.append((p + "post_attention_layernorm.weight", "F16", (hidden,), ones(hidden)))
        orders = {}
        for name, rows, cols, key in projections(hidden, inter, heads, kv_heads, head_dim):
            order = None
            if method == "gptq-act":
                order = orders.setdefault(key, rng.permutation(cols))
            for suffix, dtype, shp, make in packed(method, rows, cols, rng, order):
                tensors.append((f"{p}{name}.{suffix}", dtype, shp, make))
    tensors.append(("model.norm.weight", "F16", (hidden,), ones(hidden)))
    if not tied:
        tensors.append(("lm_head.weight", "F16", (vocab, hidden), lambda: f16_normal((vocab, hidden))))

    size = {"F16": 2, "I32": 4}
    header, offset = {}, 0
    for name, dtype, shp, _ in tensors:
        n = size[dtype] * int(np.prod(shp))
        header[name] = {"dtype": dtype, "shape": list(shp), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, make in tensors:
            f.write(np.ascontiguousarray(make()).tobytes())

    quant = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    if method != "awq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": method == "gptq-act",
                 "sym": method == "gptq-sym", "checkpoint_format": "gptq"}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": theta, "tie_word_embeddings": tied,
        "max_position_embeddings": 131072, "hidden_act": "silu", "torch_dtype": "float16",
        "bos_token_id": 0, "eos_token_id": 1, "quantization_config": quant,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(tokenizer, out / "tokenizer.json")
    print(f"{out}: {offset / 2**20:.0f} MiB of tensors")


if __name__ == "__main__":
    main()
