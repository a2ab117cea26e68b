"""What DeepSeek V4's checkpoint says beyond its geometry (models/deepseek_v4.py): its two ropes
as transformers 5.24's `DeepseekV4Config` resolves them, and its tensors' names mapped to the
model's (FP8 block-quantized files are dequantized before, in models/fp8_weights.py).

Ropes: "main" rotates the sliding-only layers, "compress" the CSA and HCA layers (their queries,
keys and output, their compressors' and indexer's entries). A config that ships one flat
`rope_scaling` / `rope_parameters` (DeepSeek's release: YaRN for the long context) scales the
compress rope only, at `compress_rope_theta`, with YaRN's attention factor forced to 1 (V4's
reference does not scale cos and sin); a nested `{main, compress}` is taken as written."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from models.spec import ModelSpec

# the rope types whose frequencies are fixed at load (models/layers.py `rope_inv_freq`)
_ROPES = ("default", "linear", "llama3", "yarn")
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


def v4_ropes(cfg: dict, partial: float) -> dict[str, tuple[float, dict | None]]:
    """{"main", "compress"} -> (theta, the scaling for models/layers.py or None); ValueError,
    with the reason, for a rope type kvserve does not serve."""
    theta = float(cfg.get("rope_theta", 10000.0))
    given = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
        ropes = {label: {"rope_theta": theta, **given[label]} for label in ("main", "compress")}
    else:
        flat = {k: v for k, v in given.items() if k not in ("main", "compress")}
        compress = {
            **flat,
            "rope_theta": float(cfg.get("compress_rope_theta", 160000.0)),
            "partial_rotary_factor": partial,
        }
        compress["rope_type"] = flat.get("rope_type", flat.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        ropes = {"main": {"rope_type": "default", "rope_theta": theta}, "compress": compress}
    out: dict[str, tuple[float, dict | None]] = {}
    for label, rope in ropes.items():
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in _ROPES:
            why = (
                "it rescales with each batch's length"
                if kind in ("dynamic", "longrope")
                else "transformers' V4 has no such rope"
            )
            raise ValueError(
                f"DeepSeek V4 {label} rope {kind!r} is not supported ({why}; "
                f"served: {', '.join(_ROPES)})"
            )
        if float(rope.get("partial_rotary_factor", partial)) != partial:
            raise ValueError(
                f"DeepSeek V4 {label} rope: a partial_rotary_factor of its own is "
                "not supported (the layers' rotary width is the config's)"
            )
        if rope.get("truncate") is False:
            raise ValueError(
                f"DeepSeek V4 {label} rope: YaRN truncate false is not supported "
                "(transformers' V4 always truncates its correction range)"
            )
        if kind in _NEEDS_ORIGINAL:
            rope.setdefault(
                "original_max_position_embeddings", cfg.get("max_position_embeddings", 1 << 20)
            )
        if kind != "default" and rope.get("factor") is None:
            raise ValueError(f"DeepSeek V4 {label} rope {kind!r} without a factor")
        scaling = {**rope, "rope_type": kind} if kind != "default" else None
        out[label] = (float(rope["rope_theta"]), scaling)
    return out


# ---- checkpoint names ---------------------------------------------------------------------------

# the files' names (DeepSeek's, as transformers' save_pretrained writes them back) under
# "model.layers.N." -> the model's under "layers.N."
_LAYER_NAMES = {
    "attn.attn_sink": "attn.sinks",
    "attn.wq_a.weight": "attn.q_a.weight",
    "attn.q_norm.weight": "attn.q_a_norm",
    "attn.wq_b.weight": "attn.q_b.weight",
    "attn.wkv.weight": "attn.kv.weight",
    "attn.norm.weight": "attn.kv_norm",
    "attn.wo_a.weight": "attn.o_a",
    "attn.wo_b.weight": "attn.o_b.weight",
    "attn.compressor.ape": "attn.compressor.position_bias",
    "attn.compressor.norm.weight": "attn.compressor.norm",
    "attn.compressor.wkv.weight": "attn.compressor.kv.weight",
    "attn.compressor.wgate.weight": "attn.compressor.gate.weight",
    "attn.indexer.compressor.ape": "attn.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "attn.indexer.norm",
    "attn.indexer.compressor.wkv.weight": "attn.indexer.kv.weight",
    "attn.indexer.compressor.wgate.weight": "attn.indexer.gate.weight",
    "attn.indexer.weights_proj.weight": "attn.indexer.weights.weight",
    "attn.indexer.wq_b.weight": "attn.indexer.q_b.weight",
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "ffn_norm",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "ffn.gate.weight": "ffn.router.weight",
    "ffn.gate.bias": "ffn.router_bias",
    "ffn.gate.tid2eid": "ffn.tid2eid",
    "ffn.shared_experts.w2.weight": "ffn.shared_down.weight",
}
_TOP = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "embed.weight": "embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "model.norm.weight": "norm",
    "norm.weight": "norm",
    "model.hc_head.hc_fn": "hc_head.fn",
    "hc_head_fn": "hc_head.fn",
    "model.hc_head.hc_base": "hc_head.base",
    "hc_head_base": "hc_head.base",
    "model.hc_head.hc_scale": "hc_head.scale",
    "hc_head_scale": "hc_head.scale",
}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_SHARED = re.compile(r"ffn\.shared_experts\.(w1|w3)\.weight")


def deepseek_v4_weights(
    weights: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under the model's names; an expert's w1/w3 (gate, up) and w2
    (down) land in their rows of the layer's stacked tensors, gathered here per layer."""
    inter = spec.layers[0].intermediate_size
    pending: dict[str, torch.Tensor] = {}
    for name, t in weights:
        if name.startswith("layers."):  # DeepSeek's own files: no "model." prefix
            name = "model." + name
        if name in _TOP:
            yield _TOP[name], t
            continue
        if name.startswith("mtp.") or ".mtp." in name:
            continue  # the multi-token-prediction layers: not instantiated (as transformers)
        if not name.startswith("model.layers."):
            raise ValueError(f"unexpected tensor {name}")
        idx, rest = name[len("model.layers.") :].split(".", 1)
        lay = spec.layers[int(idx)]
        expert, shared = _EXPERT.fullmatch(rest), _SHARED.fullmatch(rest)
        if expert:
            key = f"layers.{idx}.ffn.{'down' if expert[2] == 'w2' else 'gate_up'}"
            stack = pending.get(key)
            if stack is None:
                e = lay.num_experts
                shape = (e, *t.shape) if expert[2] == "w2" else (e, 2 * inter, t.shape[1])
                stack = pending[key] = t.new_zeros(shape)
            rows = {"w1": slice(0, inter), "w3": slice(inter, None), "w2": slice(None)}[expert[2]]
            stack[int(expert[1]), rows] = t
            continue
        if shared:
            key = f"layers.{idx}.ffn.shared_gate_up.weight"
            whole = pending.setdefault(key, t.new_zeros(2 * t.shape[0], t.shape[1]))
            whole[slice(0, t.shape[0]) if shared[1] == "w1" else slice(t.shape[0], None)] = t
            continue
        if rest not in _LAYER_NAMES:
            raise ValueError(f"unexpected tensor {name}")
        yield f"layers.{idx}.{_LAYER_NAMES[rest]}", t
    yield from pending.items()
