"""The default model's weights in the forms peer servers read, all dequantized from the same GGUF
so every engine in a comparison computes with the same float32 numbers.

    python tools/export_gguf.py --out bench/.peers/models  # <stem>.{F32,BF16,Q8_0}.gguf, hf/

- `gguf_as(..., "F32" | "BF16" | "Q8_0")`: the GGUF with every tensor dequantized to F32, then
  (BF16, Q8_0) re-encoded by the `gguf` package: matrices in that type, 1-D tensors (norms) F32,
  as llama.cpp's own converter does (metadata copied; llama.cpp's q/k permutation kept, since
  llama.cpp reads it) -- for llama.cpp's servers at each precision, and Q8_0 for
  `--quantization int8` loading a Q8_0 file.
- `hf_dir`: a transformers checkpoint (safetensors + tokenizer + chat template) -- for vLLM and
  the naive transformers baseline. transformers' own GGUF reader does the conversion.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

FILE_TYPES = {"F32": "ALL_F32", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0"}


def gguf_as(src: str, dst: Path, kind: str = "F32") -> Path:
    import gguf

    if dst.exists():
        return dst
    qtype = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for field in reader.fields.values():
        # GGUF.* are the container's own fields; the writer sets architecture itself
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[kind]])
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # the reader gives numpy order (reversed GGML dims); the writer wants the same
        data = data.reshape([int(d) for d in reversed(t.shape)])
        if kind == "F32" or data.ndim < 2:
            writer.add_tensor(t.name, data)
        else:
            encoded = gguf.quants.quantize(data, qtype)
            writer.add_tensor(t.name, encoded, raw_shape=encoded.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dst) + ".tmp", dst)
    return dst


def hf_dir(src: str, dst: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (dst / "config.json").exists():
        return dst
    d, f = os.path.split(src)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained (it counts as quantized): copy its
    # dequantized weights into a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(dst, safe_serialization=True)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(dst)
    return dst


def main() -> None:
    from models.loader import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="source GGUF (default: SmolLM2)")
    ap.add_argument("--out", default="bench/.peers/models")
    args = ap.parse_args()
    src = args.model or default_model_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for kind in FILE_TYPES:
        print(gguf_as(src, out / f"{Path(src).stem}.{kind}.gguf", kind))
    print(hf_dir(src, out / "hf"))


if __name__ == "__main__":
    main()
