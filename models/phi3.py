"""Phi-3 / Phi-3.5 / Phi-4-mini checkpoints (`Phi3ForCausalLM`) on the Llama decoder.

Their `qkv_proj` ([q ; k ; v]) and `gate_up_proj` ([gate ; up]) are already the decoder's fused
layouts, so they load whole. Phi-4-mini rotates only part of each head (`partial_rotary_factor`).

LongRoPE (`rope_type` "longrope", Phi-3's "su"): two sets of per-frequency divisors, short for
contexts up to `original_max_position_embeddings` and long beyond, and cos/sin scaled by an
attention factor. transformers switches sets when a forward's length crosses the original
context, so one sequence's KV can mix both; vLLM picks per batch. kvserve picks once for the
served context, as llama.cpp does: long where `max_model_len` exceeds the original context, short
otherwise, so a token's numbers never depend on its neighbours or on how long its request grew.
"""

from __future__ import annotations


def phi3_fields(cfg: dict, context: int | None) -> dict:
    """The `ModelSpec` fields a Phi-3 config sets beyond the Llama family's; `context` is the
    served `max_model_len` (None: the config's `max_position_embeddings`)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    fields: dict = {"partial_rotary_factor": float(factor)}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("longrope", "su"):
        longest = cfg.get("max_position_embeddings", 4096)
        original = (
            scaling.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or longest
        )
        fields["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": list(scaling["short_factor"]),
            "long_factor": list(scaling["long_factor"]),
            "original_max_position_embeddings": original,
            "factor": scaling.get("factor") or longest / original,
            "attention_factor": scaling.get("attention_factor"),
            "use_long": (context or longest) > original,
        }
    return fields
