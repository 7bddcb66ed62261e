#!/usr/bin/env python3
"""Writes a random-weight f16 GGUF of a BERT encoder with a real model's shape, as llama.cpp's
converter writes a `bert` file, for embedding benchmarks that read one file with both kiln and
llama.cpp (quantize it with `llama-quantize` for other types).

    python3 scripts/bench/encoder_shape_gguf.py SHAPE OUT.gguf

SHAPE is `bge-small` (BAAI/bge-small-en-v1.5: 12 layers, hidden 384, 12 heads, FFN 1536, 512
positions, 30522 tokens, CLS pooling) or `bge-base` (hidden 768, FFN 3072). The vocabulary is
made here, in llama.cpp's phantom-space form of WordPiece: BERT's special tokens at their ids
(`[PAD]` 0, `[UNK]` 100, `[CLS]` 101, `[SEP]` 102, `[MASK]` 103), single characters with and
without `##`, then made-up syllable words and `##` suffixes up to the vocabulary size, so random
text tokenizes into many tokens per word as real text does. Weights are N(0, 0.02) from a fixed
seed, LayerNorms 1 and 0, biases 0.02-scaled noise: the same file on every run. Needs the `gguf`
and `numpy` packages.
"""

import itertools
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, PoolingType
from gguf.constants import TokenType

SHAPES = {
    # hidden, FFN, layers, heads, positions, vocabulary
    "bge-small": (384, 1536, 12, 12, 512, 30522),
    "bge-base": (768, 3072, 12, 12, 512, 30522),
}
PHANTOM = "\u2581"


def vocabulary(size):
    specials = {0: "[PAD]", 100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]"}
    tokens = [specials.get(i, f"[unused{i}]") for i in range(104)]
    types = [TokenType.CONTROL] * len(tokens)
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"()-")
    pieces = [PHANTOM + c for c in chars] + chars
    syllables = ["".join(p) for p in itertools.product("bcdfghklmnprstvwz", "aeiou")]
    words = itertools.chain(
        (PHANTOM + a + b for a, b in itertools.product(syllables, repeat=2)),
        (a + b for a, b in itertools.product(syllables, repeat=2)),
        (PHANTOM + a + b + c for a, b, c in itertools.product(syllables, repeat=3)),
    )
    for piece in itertools.chain(pieces, words):
        if len(tokens) == size:
            break
        tokens.append(piece)
        types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def tensors(hidden, ffn, layers, positions, vocab):
    """(name, numpy shape in row-major order, kind): `matrix` f16, `norm` (1s) and `bias`
    f32, as llama.cpp's converter writes a BERT model's."""
    yield "token_embd.weight", (vocab, hidden), "matrix"
    yield "token_types.weight", (2, hidden), "bias"
    yield "position_embd.weight", (positions, hidden), "matrix"
    yield "token_embd_norm.weight", (hidden,), "norm"
    yield "token_embd_norm.bias", (hidden,), "bias"
    for i in range(layers):
        b = f"blk.{i}."
        for name, rows, cols in [("attn_q", hidden, hidden), ("attn_k", hidden, hidden),
                                 ("attn_v", hidden, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)]:
            yield b + name + ".weight", (rows, cols), "matrix"
            yield b + name + ".bias", (rows,), "bias"
            if name == "attn_output":
                yield b + "attn_output_norm.weight", (hidden,), "norm"
                yield b + "attn_output_norm.bias", (hidden,), "bias"
        yield b + "layer_output_norm.weight", (hidden,), "norm"
        yield b + "layer_output_norm.bias", (hidden,), "bias"


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(SHAPES)}}} OUT.gguf")
    name, out = sys.argv[1:]
    hidden, ffn, layers, heads, positions, vocab = SHAPES[name]
    tokens, types = vocabulary(vocab)
    w = GGUFWriter(out, "bert")
    w.add_name(f"random-weight {name} shape")
    w.add_context_length(positions)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(PoolingType.CLS)
    w.add_file_type(1)  # mostly f16
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(2)
    w.add_bos_token_id(101)
    w.add_eos_token_id(102)
    w.add_sep_token_id(102)
    w.add_unk_token_id(100)
    w.add_pad_token_id(0)
    w.add_mask_token_id(103)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    specs = list(tensors(hidden, ffn, layers, positions, vocab))
    for tname, shape, kind in specs:
        dtype = np.float16 if kind == "matrix" else np.float32
        raw = GGMLQuantizationType.F16 if kind == "matrix" else GGMLQuantizationType.F32
        w.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize,
                          raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for tname, shape, kind in specs:
        if kind == "norm":
            data = np.ones(shape, dtype=np.float32)
        else:
            data = rng.standard_normal(shape, dtype=np.float32) * 0.02
            if kind == "matrix":
                data = data.astype(np.float16)
        w.write_tensor_data(data)
    w.close()
    print(f"{out}: {name} shape, {len(specs)} tensors", file=sys.stderr)


if __name__ == "__main__":
    main()
