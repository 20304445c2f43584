"""Write a copy of a GGUF with its block weights re-quantized to another type (for benchmarks).

The default model ships as Q4_1; the formats people download are Q4_0 and Q8_0. This rewrites
every 2-D block weight (not the token embedding, which keeps the file's type, as llama.cpp's
``llama-quantize`` keeps it at Q8_0 for this model) through ``gguf.quants`` and copies the
metadata. Do not commit the outputs.

    .venv/bin/python -m ops.bench.requantize Q4_0 /tmp/smollm2-q4_0.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from services.worker.loaders import default_model_path


def requantize(source: Path, target: Path, qtype: QType) -> None:
    reader = GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        kind = QType(t.tensor_type)
        shape = tuple(reversed([int(x) for x in t.shape]))
        if len(shape) == 2 and t.name != "token_embd.weight" and kind != qtype:
            dense = np.asarray(dequantize(t.data, kind), dtype=np.float32).reshape(shape)
            writer.add_tensor(t.name, quantize(dense, qtype), raw_dtype=qtype)
        elif kind in (QType.F32, QType.F16):
            writer.add_tensor(t.name, np.array(t.data))
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("type", choices=["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
    p.add_argument("out", type=Path)
    p.add_argument("--source", type=Path, default=None, help="default: the default model")
    args = p.parse_args()
    requantize(args.source or default_model_path(), args.out, QType[args.type])


if __name__ == "__main__":
    main()
