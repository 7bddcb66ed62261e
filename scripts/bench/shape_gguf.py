#!/usr/bin/env python3
"""Writes a random-weight f16 GGUF with the tensor shapes of a real model, for benchmarks that
read one file with both kiln and llama.cpp (quantize it with `llama-quantize` first).

    python3 scripts/bench/shape_gguf.py SHAPE TOKENIZER_GGUF OUT.gguf

SHAPE is `llama-3.2-1b`, `llama-3.1-8b`, `qwen3-30b-a3b-12l` (Qwen3-30B-A3B's tensors with 12
of its 48 layers: 128 experts of FFN 768 per layer, 8 per token, stacked in one
`ffn_*_exps` tensor per layer as llama.cpp writes them), `deepseek-v2-lite-6l`
(DeepSeek-V2-Lite's tensors with 6 of its 27 layers, the first dense: latent attention with
kv_lora_rank 512 as llama.cpp's converter now writes it, `attn_k_b` / `attn_v_b`; 64 experts
of FFN 1408, 6 per token, 2 shared; with DeepSeek-V2's compressed query of rank 1536, since
llama.cpp reads an uncompressed one only from a 27-layer file), `gpt-oss-20b-6l` (gpt-oss-20b's
tensors with 6 of its 24 layers: 64 query / 8 KV heads of 64 with biases and sinks, 32 experts
of FFN 2880 with biases, 4 per token, sliding window 128 every other layer, YaRN; quantize it
with `MXFP4_MOE` for the released checkpoint's MXFP4 experts) or `qwen3-embedding-0.6b`
(Qwen3-Embedding-0.6B: a Qwen3 decoder with q/k norms and head dim 128, `qwen3.pooling_type`
3, last-token pooling, as llama.cpp's converter writes an embedding model); `tiny-256` and `tiny-moe-256` are the
small test shapes of `scripts/fixtures/make_gguf_type_fixtures.sh` (and `tiny-deepseek-256`,
a two-layer `deepseek2` of the same widths) (rows of 256, the K-quants'
block, and weights of std 0.08 so that the logits spread). The tokenizer (vocabulary, scores, token types,
special ids) is copied from TOKENIZER_GGUF (the default model's file is fine) and cut or padded
to the shape's vocabulary. Weights are N(0, 0.02) from a fixed seed, norms are 1, so the file is
the same on every run; tensors are written one at a time (an 8B shape never sits in memory).
Needs the `gguf` and `numpy` packages.
"""

import sys

import numpy as np
from gguf import (ExpertGatingFuncType, GGMLQuantizationType, GGUFReader, GGUFWriter, PoolingType,
                  RopeScalingType)
from gguf.constants import TokenType

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings, rope theta
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, True, 500000.0),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, False, 500000.0),
    "qwen3-30b-a3b-12l": (2048, 6144, 12, 32, 4, 151936, False, 1000000.0),
    "qwen3-embedding-0.6b": (1024, 3072, 28, 16, 8, 151669, True, 1000000.0),
    "deepseek-v2-lite-6l": (2048, 10944, 6, 16, 1, 102400, False, 10000.0),
    "gpt-oss-20b-6l": (2880, 2880, 6, 64, 8, 201088, False, 150000.0),
    "tiny-256": (256, 512, 1, 4, 2, 512, True, 10000.0),
    "tiny-moe-256": (256, 512, 1, 4, 2, 512, True, 10000.0),
    "tiny-deepseek-256": (256, 512, 2, 4, 1, 512, False, 10000.0),
}
# Dense shapes of another architecture than llama: architecture, head dim (with q/k norms),
# llama.cpp's pooling type (0: none).
DENSE = {"qwen3-embedding-0.6b": ("qwen3", 128, 3)}
# Latent attention shapes: kv_lora_rank, qk_nope, qk_rope, v_head; experts, per token, expert
# FFN, shared experts, leading dense layers.
LATENT = {
    "deepseek-v2-lite-6l": (512, 128, 64, 128, 64, 6, 1408, 2, 1, 1536),
    "tiny-deepseek-256": (256, 64, 32, 64, 4, 2, 256, 1, 1, 256),
}
# Weight std by shape (default 0.02).
STD = {"tiny-256": 0.08, "tiny-moe-256": 0.08, "tiny-deepseek-256": 0.08}
# Router std by shape (default 0.5): wider keeps a test file's picks far from ties, so 8-bit
# activations do not flip them.
ROUTER_STD = {"tiny-deepseek-256": 2.0}
# The mixture-of-experts shapes: architecture, head dim, experts, experts per token, expert FFN.
EXPERTS = {
    "qwen3-30b-a3b-12l": ("qwen3moe", 128, 128, 8, 768),
    "tiny-moe-256": ("qwen3moe", 64, 4, 2, 256),
}


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    if len(f.types) and f.types[0].name == "ARRAY":
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def tokenizer(path, vocab):
    reader = GGUFReader(path)
    tokens = field(reader, "tokenizer.ggml.tokens")
    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = field(reader, "tokenizer.ggml.token_type") or [int(TokenType.NORMAL)] * len(tokens)
    model = field(reader, "tokenizer.ggml.model") or "llama"
    specials = {
        key: field(reader, f"tokenizer.ggml.{key}_token_id")
        for key in ("bos", "eos", "unknown", "padding")
    }
    tokens, scores, types = tokens[:vocab], scores[:vocab], types[:vocab]
    for i in range(len(tokens), vocab):
        tokens.append(f"<unused_shape_{i}>")
        scores.append(-1e9)
        types.append(int(TokenType.UNUSED))
    specials = {k: v for k, v in specials.items() if v is not None and v < vocab}
    return model, tokens, scores, types, specials


def tensors(hidden, inter, layers, heads, kv_heads, vocab, tied, experts=None, qk_head_dim=None):
    """(name, numpy shape in row-major order, is a norm) for every tensor: float32 for norms
    and the router, f16 for the rest. `qk_head_dim`: a dense Qwen3's head dim (q/k norms)."""
    head_dim = experts[1] if experts else qk_head_dim or hidden // heads
    yield "token_embd.weight", (vocab, hidden), False
    for i in range(layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (hidden,), True
        yield b + "attn_q.weight", (heads * head_dim, hidden), False
        yield b + "attn_k.weight", (kv_heads * head_dim, hidden), False
        yield b + "attn_v.weight", (kv_heads * head_dim, hidden), False
        yield b + "attn_output.weight", (hidden, heads * head_dim), False
        if experts or qk_head_dim:
            yield b + "attn_q_norm.weight", (head_dim,), True
            yield b + "attn_k_norm.weight", (head_dim,), True
        yield b + "ffn_norm.weight", (hidden,), True
        if experts:
            _, _, n, _, width = experts
            yield b + "ffn_gate_inp.weight", (n, hidden), True
            yield b + "ffn_gate_exps.weight", (n, width, hidden), False
            yield b + "ffn_up_exps.weight", (n, width, hidden), False
            yield b + "ffn_down_exps.weight", (n, hidden, width), False
            continue
        yield b + "ffn_gate.weight", (inter, hidden), False
        yield b + "ffn_up.weight", (inter, hidden), False
        yield b + "ffn_down.weight", (hidden, inter), False
    yield "output_norm.weight", (hidden,), True
    if not tied:
        yield "output.weight", (vocab, hidden), False


# gpt-oss shapes: head dim, experts, experts per token, sliding window.
GPT_OSS = {"gpt-oss-20b-6l": (64, 32, 4, 128)}


def gpt_oss_tensors(hidden, inter, layers, heads, kv_heads, vocab, shape):
    """The tensors of a `gpt-oss` file, as `tensors` (biases and sinks count as norms: f32)."""
    head_dim, n, _, _ = shape
    yield "token_embd.weight", (vocab, hidden), False
    for i in range(layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (hidden,), True
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            yield b + name + ".weight", (rows, hidden), False
            yield b + name + ".bias", (rows,), True
        yield b + "attn_output.weight", (hidden, heads * head_dim), False
        yield b + "attn_output.bias", (hidden,), True
        yield b + "attn_sinks.weight", (heads,), True
        yield b + "post_attention_norm.weight", (hidden,), True
        yield b + "ffn_gate_inp.weight", (n, hidden), True
        yield b + "ffn_gate_inp.bias", (n,), True
        for name, shape_ in (("ffn_gate_exps", (n, inter, hidden)), ("ffn_up_exps", (n, inter, hidden)),
                             ("ffn_down_exps", (n, hidden, inter))):
            yield b + name + ".weight", shape_, False
            yield b + name + ".bias", (n, shape_[1]), True
    yield "output_norm.weight", (hidden,), True
    yield "output.weight", (vocab, hidden), False


def add_gpt_oss_keys(w, shape):
    """A `gpt-oss` file's keys beyond the shared ones (YaRN as gpt-oss-20b has it)."""
    head_dim, n, k, window = shape
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(n)
    w.add_expert_used_count(k)
    w.add_expert_feed_forward_length(2880)
    w.add_sliding_window(window)
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)


def latent_tensors(hidden, inter, layers, heads, vocab, shape):
    """The tensors of a `deepseek2` file with a compressed query, as `tensors`."""
    r, dn, dr, dv, n, _, width, shared, dense, q_rank = shape
    yield "token_embd.weight", (vocab, hidden), False
    for i in range(layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (hidden,), True
        yield b + "attn_q_a.weight", (q_rank, hidden), False
        yield b + "attn_q_a_norm.weight", (q_rank,), True
        yield b + "attn_q_b.weight", (heads * (dn + dr), q_rank), False
        yield b + "attn_kv_a_mqa.weight", (r + dr, hidden), False
        yield b + "attn_kv_a_norm.weight", (r,), True
        yield b + "attn_k_b.weight", (heads, r, dn), False
        yield b + "attn_v_b.weight", (heads, dv, r), False
        yield b + "attn_output.weight", (hidden, heads * dv), False
        yield b + "ffn_norm.weight", (hidden,), True
        if i < dense:
            yield b + "ffn_gate.weight", (inter, hidden), False
            yield b + "ffn_up.weight", (inter, hidden), False
            yield b + "ffn_down.weight", (hidden, inter), False
            continue
        yield b + "ffn_gate_inp.weight", (n, hidden), True
        yield b + "ffn_gate_exps.weight", (n, width, hidden), False
        yield b + "ffn_up_exps.weight", (n, width, hidden), False
        yield b + "ffn_down_exps.weight", (n, hidden, width), False
        yield b + "ffn_gate_shexp.weight", (shared * width, hidden), False
        yield b + "ffn_up_shexp.weight", (shared * width, hidden), False
        yield b + "ffn_down_shexp.weight", (hidden, shared * width), False
    yield "output_norm.weight", (hidden,), True
    yield "output.weight", (vocab, hidden), False


def add_latent_keys(w, shape):
    """A `deepseek2` file's latent attention and expert keys."""
    r, dn, dr, dv, n, k, width, shared, dense, q_rank = shape
    w.add_q_lora_rank(q_rank)
    w.add_key_length(r + dr)
    w.add_value_length(r)
    w.add_key_length_mla(dn + dr)
    w.add_value_length_mla(dv)
    w.add_kv_lora_rank(r)
    w.add_leading_dense_block_count(dense)
    w.add_expert_count(n)
    w.add_expert_used_count(k)
    w.add_expert_shared_count(shared)
    w.add_expert_feed_forward_length(width)
    w.add_expert_weights_scale(1.0)
    w.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(SHAPES)}}} TOKENIZER_GGUF OUT.gguf")
    name, tok_path, out = sys.argv[1:]
    hidden, inter, layers, heads, kv_heads, vocab, tied, theta = SHAPES[name]
    model, tokens, scores, types, specials = tokenizer(tok_path, vocab)

    experts = EXPERTS.get(name)
    latent = LATENT.get(name)
    oss = GPT_OSS.get(name)
    dense_arch, qk_head_dim, pooling = DENSE.get(name, ("llama", None, 0))
    arch = experts[0] if experts else "deepseek2" if latent else "gpt-oss" if oss else dense_arch
    head_dim = (experts[1] if experts else latent[2] if latent else oss[0] if oss
                else qk_head_dim or hidden // heads)
    w = GGUFWriter(out, arch)
    w.add_name(f"random-weight {name} shape")
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6 if experts or qk_head_dim else 1e-5)
    if qk_head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if pooling:
        w.add_pooling_type(PoolingType(pooling))
    if latent:
        add_latent_keys(w, latent)
    if oss:
        add_gpt_oss_keys(w, oss)
    if experts:
        _, _, n, k, width = experts
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(n)
        w.add_expert_used_count(k)
        w.add_expert_feed_forward_length(width)
    w.add_vocab_size(vocab)
    w.add_file_type(1)  # mostly f16
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for key, value in specials.items():
        getattr(w, {"unknown": "add_unk_token_id", "padding": "add_pad_token_id"}.get(
            key, f"add_{key}_token_id"))(value)

    if latent:
        specs = list(latent_tensors(hidden, inter, layers, heads, vocab, latent))
    elif oss:
        specs = list(gpt_oss_tensors(hidden, inter, layers, heads, kv_heads, vocab, oss))
    else:
        specs = list(tensors(hidden, inter, layers, heads, kv_heads, vocab, tied, experts, qk_head_dim))
    for tname, shape, norm in specs:
        dtype = np.float32 if norm else np.float16
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize,
                          raw_dtype=GGMLQuantizationType.F32 if norm else GGMLQuantizationType.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for tname, shape, norm in specs:
        if tname.endswith("ffn_gate_inp.weight"):
            # A router with spread logits, so that tokens pick varied experts.
            data = rng.standard_normal(shape, dtype=np.float32) * ROUTER_STD.get(name, 0.5)
        elif norm:
            data = np.ones(shape, dtype=np.float32)
        else:
            std = STD.get(name, 0.02)
            data = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)
        w.write_tensor_data(data)
        print(f"{tname} {shape}", file=sys.stderr)
    w.close()


if __name__ == "__main__":
    main()
