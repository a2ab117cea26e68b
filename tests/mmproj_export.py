"""Write a tiny Gemma 3 vision checkpoint's image path as the mmproj file llama.cpp's
`convert_hf_to_gguf.py --mmproj` writes (its `MmprojModel` and `Gemma3VisionModel`):
general.architecture `clip`, general.type `mmproj`, the `clip.*` metadata, tensor names from the
`gguf` package's own MMPROJ table, the soft-embedding norm stored as `1 + w`, the input
projection forced to F16 and the embeddings to F32 whatever the output type, 1-D tensors in
F32, the other matrices in `matrix_type`. The text model goes through tests/gguf_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

from tests.gguf_export import add_blocks, finish


def _converter_name(name: str) -> str:
    """A transformers 5 tensor name as the original Gemma 3 checkpoints spell it (the names the
    converter's table knows): "vision_tower.vision_model.*", "..._weight" as ".weight"."""
    name = name.removeprefix("model.").replace("_weight", ".weight")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


def write_mmproj(
    hf_dir: Path,
    out: Path,
    matrix_type: str = "F16",
    projector_type: str = "gemma3",
    projection_dim: int | None = None,
) -> Path:
    """`hf_dir`'s tower and projector as `out`. `projector_type` and `projection_dim` (the text
    width the projector claims) may be set otherwise, to write the files kvserve refuses."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    vision = cfg["vision_config"]
    pre = json.loads((hf_dir / "preprocessor_config.json").read_text())
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(
        gguf.LlamaFileType.ALL_F32
        if matrix_type == "F32"
        else gguf.LlamaFileType[f"MOSTLY_{matrix_type}"]
    )
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(projection_dim or cfg["text_config"]["hidden_size"])
    w.add_vision_image_size(vision["image_size"])
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["num_hidden_layers"])
    w.add_vision_head_count(vision["num_attention_heads"])
    w.add_vision_image_mean(pre["image_mean"])
    w.add_vision_image_std(pre["image_std"])
    w.add_clip_projector_type(projector_type)
    w.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    w.add_vision_use_gelu(True)
    per_side = int(pre.get("image_seq_length", 256) ** 0.5)
    scale = (vision["image_size"] // vision["patch_size"]) // per_side
    if scale > 0 and scale != 4:  # the converter writes the factor only off its default
        w.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    qtype = gguf.GGMLQuantizationType[matrix_type]
    hf = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    for hf_name, t in hf.items():
        name = _converter_name(hf_name)
        if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        a = np.ascontiguousarray(t.float().numpy())
        if "soft_emb_norm.weight" in name:
            a = a + 1.0  # Gemma's RMSNorm (1 + w), folded in
        if "input_projection" in name:
            w.add_tensor(gguf_name, a.astype(np.float16))
        elif ".embeddings." in name or a.ndim <= 1 or matrix_type == "F32":
            w.add_tensor(gguf_name, a)
        elif matrix_type == "F16":
            w.add_tensor(gguf_name, a.astype(np.float16))
        else:
            add_blocks(w, gguf_name, a, qtype)
    return finish(w, out)
