#!/usr/bin/env python3
"""Writes a copy of a GGUF file with every quantized tensor dequantized to F16.

Used to make a float target for the draft-model speculation benchmark out of the default model
(Gemma 3 270M Q4_K_M): the result has the same metadata and tokenizer, F32 tensors stay F32.
Needs the `gguf` and `numpy` packages (pip install gguf numpy).

    python3 scripts/bench/dequantize_gguf.py IN.gguf OUT.gguf
"""

import sys

import gguf
import numpy as np


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF header fields itself; the file type
        # changes.
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    kept = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for tensor in reader.tensors:
        if tensor.tensor_type in kept:
            data, raw = np.array(tensor.data), tensor.tensor_type
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float16)
            raw = gguf.GGMLQuantizationType.F16
        writer.add_tensor(tensor.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
