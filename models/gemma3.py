"""Gemma 3 text checkpoints (`Gemma3ForCausalLM`, model_type "gemma3_text") on the Llama decoder.

What Gemma changes, each a `ModelSpec` field the decoder honours: embeddings scaled by
sqrt(hidden); RMSNorm before *and after* attention and the FFN (`sandwich_norms`), every norm
`(1 + w)`-weighted (the `1 +` is folded into the weights here, as llama.cpp's converter does);
q/k norms; GeGLU (tanh-approximate GELU); a softmax scale of `query_pre_attn_scalar ** -0.5`;
sliding-window layers with their own rope base interleaved with global layers (5:1); a tied head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from models.gemma3_vision import is_image_path_tensor

# HF names under "model.layers.N." that differ from the Llama family's. HF's
# `post_attention_layernorm` is the norm *on* the attention output; the decoder's own
# `post_attention_layernorm` is the FFN's input norm (Llama's meaning), HF's `pre_feedforward_*`.
_LAYER_RENAMES = {
    "post_attention_layernorm.weight": "attn_output_norm.weight",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "ffn_output_norm.weight",
}


def gemma3_fields(cfg: dict) -> dict:
    """The `ModelSpec` fields a Gemma 3 config sets beyond the Llama family's."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:  # configs before `layer_types`: every `sliding_window_pattern`-th is global
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    params = cfg.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    window = cfg.get("sliding_window")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma attention logit soft-capping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional attention is an encoder, not served here")
    return dict(
        full_attention_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        sliding_window=window,
        rope_theta=float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
        rope_scaling=dict(scaling) if scaling else None,
        local_rope_theta=float(local.get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0)),
        qk_norm=True,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        embedding_multiplier=cfg["hidden_size"] ** 0.5,
        sandwich_norms=True,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def gemma3_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma 3 tensors under Llama-family HF names (the Llama renaming takes them from there),
    every norm weight as the `(1 + w)` it multiplies by."""
    for name, t in weights:
        if is_image_path_tensor(name):  # the tower and projector: models/gemma3_vision.py
            continue
        if name.startswith("model.language_model."):  # newer ConditionalGeneration files
            name = "model." + name[len("model.language_model.") :]
        if name.startswith("language_model."):  # a Gemma3ForConditionalGeneration's text part
            name = name[len("language_model.") :]
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers.") :].split(".", 1)
            name = f"model.layers.{idx}.{_LAYER_RENAMES.get(rest, rest)}"
        if name.endswith("norm.weight"):
            t = t + 1.0
        yield name, t
