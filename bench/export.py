"""The default model's weights in the forms peer servers read, all dequantized from the same GGUF
so every engine in a comparison computes with the same float32 numbers.

    python bench/export.py --out bench/.peers/models   # writes smollm2-f32.gguf and hf/

- `f32_gguf`: the GGUF with every tensor dequantized to F32 (metadata copied unchanged; llama.cpp's
  q/k permutation is kept, since llama.cpp reads it) -- for llama.cpp's servers.
- `hf_dir`: a transformers checkpoint (safetensors + tokenizer + chat template) -- for vLLM and
  the naive transformers baseline. transformers' own GGUF reader does the conversion.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np


def f32_gguf(src: str, dst: Path) -> Path:
    import gguf

    if dst.exists():
        return dst
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for field in reader.fields.values():
        # GGUF.* are the container's own fields; the writer sets architecture itself
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # the reader gives numpy order (reversed GGML dims); the writer wants the same
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
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
    print(f32_gguf(src, out / (Path(src).stem + ".F32.gguf")))
    print(hf_dir(src, out / "hf"))


if __name__ == "__main__":
    main()
