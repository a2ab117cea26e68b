"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) and Qwen3-VL
(`Qwen3VLForConditionalGeneration`) as the serving stack sees them: the language model is
Qwen2's, or Qwen3's (q/k norms), decoder
(models/llama.py) with M-RoPE positions (models/mrope.py: sections, or Qwen3-VL's interleaved
frequencies), the image path the tower in models/qwen_vision.py or qwen3_vision.py, whose soft
tokens replace the `<|image_pad|>` placeholders the chat template's
`<|vision_start|><|image_pad|><|vision_end|>` is widened into (one a merged patch). Read here:
the config's two halves and the text model's tensor names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from models.qwen_vision import is_qwen_vision_tensor
from models.spec import VisionSpec

# the conditional-generation architectures: (the decoder their language model is, their image
# path's `VisionSpec.architecture`)
QWEN_VL_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", "qwen2_5_vl"),
    "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", "qwen3_vl"),
}
QWEN_TOWERS = {tower for _, tower in QWEN_VL_ARCHITECTURES.values()}
# transformers' `Qwen3VLVisionConfig` defaults where models/qwen_vision.py's spec would read
# another (a config.json may leave a default out)
QWEN3_TOWER_DEFAULTS = {
    "hidden_act": "gelu_pytorch_tanh",
    "patch_size": 16,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
_NESTED = "model.language_model."  # transformers 5's spelling of the text model's tensors


def qwen_vl_config(arch: str, cfg: dict) -> tuple[str, dict, dict]:
    """(the text architecture, the text model's config, the spec fields the vision side adds:
    the VisionSpec and the M-RoPE sections and layout). The rope settings lose their M-RoPE
    part, which the decoder's plain rotary table does not read. Qwen3-VL's frequencies are
    interleaved whatever its `mrope_interleaved` says (transformers' table always is), and
    its sections default to transformers' (24, 20, 20)."""
    decoder, tower_kind = QWEN_VL_ARCHITECTURES[arch]
    qwen3 = tower_kind == "qwen3_vl"
    text = {**cfg, **cfg.get("text_config", {})}
    tower = {**(QWEN3_TOWER_DEFAULTS if qwen3 else {}), **(cfg.get("vision_config") or {})}
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(int(s) for s in rope.get("mrope_section") or ((24, 20, 20) if qwen3 else ()))
    if not section:
        raise ValueError(f"{arch}: the text config names no mrope_section")
    theta = text.get("rope_theta") or rope.get("rope_theta") or (5e5 if qwen3 else 1e6)
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        kind = rope.get("rope_type", rope.get("type"))
        raise ValueError(f"{arch}: rope type {kind!r} with M-RoPE is not supported")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    text["rope_scaling"] = None
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if 2 * sum(section) != head_dim:
        raise ValueError(
            f"{arch}: mrope_section {list(section)} does not cover half of a {head_dim}-wide head"
        )
    merge = int(tower.get("spatial_merge_size", 2))
    vision = VisionSpec(
        architecture=tower_kind,
        image_token_id=int(cfg.get("image_token_id", 151_655)),
        tokens_per_image=0,
        begin_token_id=cfg.get("vision_start_token_id", 151_652),
        end_token_id=cfg.get("vision_end_token_id", 151_653),
        tower_config=dict(tower),
        spatial_merge=merge,
        two_way=False,  # the decoder's mask stays causal over image tokens
        marker="image",
    )
    fields = {"vision": vision, "mrope_section": section, "mrope_interleaved": qwen3}
    return decoder, text, fields


def qwen_vl_text_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The language model's tensors under Qwen2's HF names; the tower's are skipped (loaded by
    the image encoder)."""
    for name, tensor in weights:
        if is_qwen_vision_tensor(name):
            continue
        yield ("model." + name[len(_NESTED) :] if name.startswith(_NESTED) else name), tensor
