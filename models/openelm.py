"""Apple OpenELM checkpoints (`OpenELMForCausalLM`, model_type "openelm") on the Llama decoder.

OpenELM scales every layer differently: per-layer `num_query_heads`, `num_kv_heads` and
`ffn_multipliers` lists, so each layer's KV has its own shape (one KV group per layer, of
different sizes in one pool). Otherwise it is a Llama: RMSNorm, RoPE (`rope_freq_constant`), RMSNorm
on q and k per head before RoPE (`normalize_qk_projections`), a GLU FFN whose `proj_1` rows are
[gate ; up] (our fused layout), tied embeddings (`share_input_output_layers`). No bias anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from models.spec import LayerSpec, ModelSpec


def make_divisible(value: float, divisor: int) -> int:
    """OpenELM's rounding of FFN widths (MobileNet's `make_divisible`)."""
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * value else new


def _per_layer(value: int | float | list, n: int) -> list:
    return list(value) if isinstance(value, list) else [value] * n


def openelm_spec(cfg: dict, eos: tuple[int, ...]) -> ModelSpec:
    n, dim, head_dim = cfg["num_transformer_layers"], cfg["model_dim"], cfg["head_dim"]
    q_heads = _per_layer(cfg["num_query_heads"], n)
    kv_heads = _per_layer(cfg["num_kv_heads"], n)
    ffn = _per_layer(cfg["ffn_multipliers"], n)
    if not cfg.get("ffn_with_glu", True):
        raise ValueError("OpenELM without a GLU FFN is not supported")
    divisor = cfg.get("ffn_dim_divisor", 256)
    layers = tuple(
        LayerSpec(q_heads[i], kv_heads[i], head_dim, make_divisible(ffn[i] * dim, divisor), i)
        for i in range(n)
    )
    return ModelSpec(
        architecture="OpenELMForCausalLM",
        vocab_size=cfg["vocab_size"],
        hidden_size=dim,
        layers=layers,
        rms_norm_eps=1e-6,
        rope_theta=float(cfg.get("rope_freq_constant", 10000)),
        max_position_embeddings=cfg.get("max_context_length", cfg.get("rope_max_length", 2048)),
        tie_word_embeddings=bool(cfg.get("share_input_output_layers", True)),
        qk_norm=bool(cfg.get("normalize_qk_projections", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
    )


# OpenELM names under "transformer.layers.N." -> the model's under "layers.N.". Its fused
# `qkv_proj` ([q ; k ; v]; every layer writes its own KV) and `proj_1` ([gate ; up]) have the
# model's row layout, so they load whole.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.qkv_proj.weight": "qkv_proj.weight",
    "attn.q_norm.weight": "q_norm.weight",
    "attn.k_norm.weight": "k_norm.weight",
    "attn.out_proj.weight": "o_proj.weight",
    "ffn.proj_1.weight": "gate_up_proj.weight",
    "ffn.proj_2.weight": "down_proj.weight",
}


def openelm_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """OpenELM tensors under the names `LlamaForCausalLM.load_weights` takes."""
    for name, t in weights:
        if name == "transformer.token_embeddings.weight":
            yield "embed_tokens.weight", t
        elif name == "transformer.norm.weight":
            yield "norm.weight", t
        elif name == "lm_head.weight":
            yield name, t
        elif name.startswith("transformer.layers."):
            idx, rest = name[len("transformer.layers.") :].split(".", 1)
            if rest not in _LAYER_NAMES:
                raise ValueError(f"unexpected OpenELM tensor {name}")
            yield f"layers.{idx}.{_LAYER_NAMES[rest]}", t
        else:
            raise ValueError(f"unexpected OpenELM tensor {name}")
