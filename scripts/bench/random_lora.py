#!/usr/bin/env python3
"""Writes a random-weight PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)
for a model of the given shape, on every attention and MLP projection: for serving benchmarks
with adapters (its outputs mean nothing). Standard library only.

    python3 scripts/bench/random_lora.py OUT_DIR --rank 16 --seed 1 \\
        --layers 18 --hidden 640 --q-dim 1024 --kv-dim 256 --intermediate 2048

(the defaults are Gemma 3 270M's shape, kiln's default model).
"""

import argparse
import array
import json
import random
import struct
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--q-dim", type=int, default=1024)
    p.add_argument("--kv-dim", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=2048)
    a = p.parse_args()
    h, q, kv, i, r = a.hidden, a.q_dim, a.kv_dim, a.intermediate, a.rank
    shapes = {  # module: (block, in, out)
        "q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv),
        "v_proj": ("self_attn", h, kv), "o_proj": ("self_attn", q, h),
        "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i), "down_proj": ("mlp", i, h),
    }
    rng = random.Random(a.seed)
    header, chunks, offset = {}, [], 0
    for layer in range(a.layers):
        for module, (block, k, n) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            for half, shape, std in (("lora_A", [r, k], k ** -0.5), ("lora_B", [n, r], 0.01)):
                data = array.array("f", (rng.gauss(0.0, std) for _ in range(shape[0] * shape[1])))
                raw = data.tobytes()
                header[f"{prefix}.{half}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
                chunks.append(raw)
                offset += len(raw)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(header).encode()
    meta += b" " * (-len(meta) % 8)
    with open(a.out / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(meta)))
        f.write(meta)
        for c in chunks:
            f.write(c)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": a.alpha, "target_modules": list(shapes),
              "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None}
    (a.out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{a.out}: rank {r}, {a.layers} layers, {offset / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
