"""Apple OpenELM checkpoints (`OpenELMForCausalLM`, model_type "openelm") on the Llama decoder.

OpenELM scales every layer differently: per-layer `num_query_heads`, `num_kv_heads` and
`ffn_multipliers` lists, so each layer's KV has its own shape (one KV group per layer, of
different sizes in one pool). Otherwise it is a Llama: RMSNorm, RoPE (`rope_freq_constant`), RMSNorm
on q and k per head before RoPE (`normalize_qk_projections`), a GLU FFN whose `proj_1` rows are
[gate ; up] (our fused layout), tied embeddings (`share_input_output_layers`). No bias anywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

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


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "ffn.proj_2.weight": "mlp.down_proj.weight",
}


def openelm_weights(
    spec: ModelSpec, weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename OpenELM tensors to the Llama names `LlamaForCausalLM.load_weights` takes, splitting
    the fused qkv_proj / proj_1 by each layer's geometry."""
    for name, t in weights:
        if name == "transformer.token_embeddings.weight":
            yield "model.embed_tokens.weight", t
        elif name == "transformer.norm.weight":
            yield "model.norm.weight", t
        elif name == "lm_head.weight":
            yield name, t
        elif name.startswith("transformer.layers."):
            idx_str, rest = name[len("transformer.layers.") :].split(".", 1)
            i, lay = int(idx_str), spec.layers[int(idx_str)]
            p = f"model.layers.{i}."
            if rest == "attn.qkv_proj.weight":
                q, kv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
                yield p + "self_attn.q_proj.weight", t[:q]
                yield p + "self_attn.k_proj.weight", t[q : q + kv]
                yield p + "self_attn.v_proj.weight", t[q + kv : q + 2 * kv]
            elif rest == "ffn.proj_1.weight":
                yield p + "mlp.gate_proj.weight", t[: lay.intermediate_size]
                yield p + "mlp.up_proj.weight", t[lay.intermediate_size :]
            elif rest in _LAYER_NAMES:
                yield p + _LAYER_NAMES[rest], t
            else:
                raise ValueError(f"unexpected OpenELM tensor {name}")
        else:
            raise ValueError(f"unexpected OpenELM tensor {name}")
