"""Laguna (`LagunaForCausalLM`, poolside's Laguna XS.2) as a variation of the Llama decoder
(models/llama.py), as transformers 5.24's `models/laguna` defines it.

What it shares with the decoder, as `ModelSpec` fields: q/k RMS norms on every layer, SwiGLU,
sliding layers interleaved with full ones (`layer_types`). What is new:

- **A query head count per layer** (`num_attention_heads_per_layer`) over one KV head count:
  `LayerSpec.num_heads` varies, the KV groups keep one shape, and tensor parallelism plans the
  heads per layer group (models/tp_plan.py).
- **Rope per layer type**: full layers rotate the first `partial_rotary_factor` of each head
  (half, by default) with their own base; sliding layers rotate the whole head with theirs.
- **A softplus output gate**: `g_proj` of the layer's normed input, one gate per head
  (`gating` true / "per-head") or per element ("per-element"), multiplies the attention output
  before `o_proj`.
- **Experts with a shared expert** on the layers `mlp_layer_types` marks "sparse" (the others
  are a dense SwiGLU of `intermediate_size`): a sigmoid router (its logits tanh-capped where
  `moe_router_logit_softcapping` > 0) picks the top k by score plus a correction bias, weighs
  them by their unbiased scores renormalised to 1, scales the routed sum by
  `moe_routed_scaling_factor` and adds the shared expert's output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from models.checkpoint import Part
from models.hf_names import (
    GATED_MLP_PARTS,
    HF_ATTENTION_NAMES,
    HF_MLP_NAMES,
    LayerNames,
    gated_mlp_names,
)
from models.layers import rope_inv_freq
from models.linear.layer import Linear
from models.llama import DecoderLayer, LlamaForCausalLM
from models.moe import Expert, MoE
from models.spec import LayerSpec, ModelSpec, hf_model_spec

ARCH = "LagunaForCausalLM"
S, F_ = "sliding_attention", "full_attention"
_DEFAULT_ROPE = {
    F_: {"rope_type": "default", "rope_theta": 500_000.0, "partial_rotary_factor": 0.5},
    S: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0},
}


def laguna_spec(cfg: dict, eos: tuple[int, ...]) -> ModelSpec:
    """The geometry of a Laguna config, with transformers' defaults for what it leaves out;
    ValueError, with the reason, for what kvserve does not serve."""
    n = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [F_] * n)
    mlp_types = list(cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1))
    heads = list(cfg.get("num_attention_heads_per_layer") or [cfg["num_attention_heads"]] * n)
    if not len(types) == len(mlp_types) == len(heads) == n:
        raise ValueError(f"Laguna's per-layer lists must each have {n} entries")
    if cfg.get("attention_bias"):
        raise ValueError("Laguna with attention biases is not supported (o_proj has none here)")
    if cfg.get("moe_apply_router_weight_on_input"):
        raise ValueError(
            "Laguna with router weights on the experts' input is not supported "
            "(transformers 5.24 refuses it too)"
        )
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if any(h % kv for h in heads):
        raise ValueError(f"Laguna's per-layer head counts {heads} must be multiples of {kv}")
    rope = {**_DEFAULT_ROPE, **(cfg.get("rope_parameters") or {})}
    for kind in set(types):
        if rope[kind].get("rope_type", "default") != "default":
            raise ValueError(f"Laguna {kind} rope {rope[kind]['rope_type']!r} is not supported")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers = []
    for i in range(n):
        sparse = mlp_types[i] == "sparse"
        layers.append(
            LayerSpec(
                num_heads=heads[i],
                num_kv_heads=kv,
                head_dim=head_dim,
                intermediate_size=cfg["moe_intermediate_size"]
                if sparse
                else cfg["intermediate_size"],
                kv_group=i,
                num_experts=cfg["num_experts"] if sparse else 0,
                num_experts_per_tok=cfg["num_experts_per_tok"] if sparse else 0,
            )
        )
    gating = cfg.get("gating", True)
    if gating not in (True, "per-head", "per-element"):
        raise ValueError(f"Laguna gating {gating!r} is not one of true, per-head, per-element")
    sliding = cfg.get("sliding_window", 512) if S in types else None
    return hf_model_spec(
        ARCH,
        cfg,
        layers,
        rope_theta=float(rope[F_]["rope_theta"]),
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=True,
        hidden_act=cfg.get("hidden_act", "silu"),
        eos_token_ids=eos,
        sliding_window=sliding,
        full_attention_layers=tuple(i for i, t in enumerate(types) if t == F_),
        local_rope_theta=float(rope[S]["rope_theta"]),
        extra={
            # the rotated share of a head per layer type (rope_table below reads them)
            "full_rotary": float(rope[F_].get("partial_rotary_factor", 1.0)),
            "sliding_rotary": float(rope[S].get("partial_rotary_factor", 1.0)),
            # tensor parallelism cuts g_proj's rows by heads in either unit (models/tp_plan.py)
            "output_gate": "element" if gating == "per-element" else "head",
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size", 512),
            "routed_scaling": float(cfg.get("moe_routed_scaling_factor", 1.0)),
            "router_softcap": float(cfg.get("moe_router_logit_softcapping") or 0.0),
        },
    )


# ---- checkpoint names ---------------------------------------------------------------------------

# HF names under "model.layers.N." -> (the model's name under "layers.N.", part of a fused one)
_LAYER_NAMES: LayerNames = {
    **HF_ATTENTION_NAMES,
    **HF_MLP_NAMES,
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attn.g_proj.weight": ("g_proj.weight", None),
    "mlp.gate.weight": ("moe.router.weight", None),
    "mlp.gate.e_score_correction_bias": ("moe.router_bias", None),
    **gated_mlp_names("mlp.shared_experts.", "moe.shared."),
}
# the checkpoint files' own names (poolside's, and what transformers' save_pretrained writes back
# through its conversion mapping) for what its modules call otherwise
_ON_DISK = {
    "mlp.experts.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_expert.gate_proj.weight": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight": "mlp.shared_experts.up_proj.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.down_proj.weight",
}
# one expert's tensor on disk: "mlp.experts.E.gate_proj.weight"
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_TOP_NAMES = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def laguna_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Part]:
    """HF Laguna tensors under the model's names with their part of a fused parameter
    (`fuse_parts` joins them). Experts either one tensor each (the files' layout) or stacked
    [E, rows, cols] (the modules' own, gate_up already [gate; up]: the decoder's order)."""
    for name, t in weights:
        if name in _TOP_NAMES:
            yield _TOP_NAMES[name], None, t
            continue
        if not name.startswith("model.layers."):
            raise ValueError(f"unexpected tensor {name}")
        idx, rest = name[len("model.layers.") :].split(".", 1)
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # stacked [E, ...]
            for e in range(t.shape[0]):
                yield f"layers.{idx}.moe.experts.{e}.{rest.rsplit('.', 1)[1]}.weight", None, t[e]
            continue
        expert = _EXPERT.fullmatch(rest)
        if expert:
            own, part = GATED_MLP_PARTS[expert[2]]
            yield f"layers.{idx}.moe.experts.{expert[1]}.{own}.weight", part, t
            continue
        rest = _ON_DISK.get(rest, rest)
        if rest not in _LAYER_NAMES:
            raise ValueError(f"unexpected tensor {name}")
        own, part = _LAYER_NAMES[rest]
        yield f"layers.{idx}.{own}", part, t


# ---- the model ----------------------------------------------------------------------------------


class LagunaMoE(MoE):
    """Sigmoid routing with a selection bias, the routed sum scaled, plus a shared expert."""

    def __init__(
        self, spec: ModelSpec, layer: LayerSpec, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__(spec.hidden_size, layer, True, act)
        h = spec.hidden_size
        # selection only: which experts win, never how much they weigh (transformers' use)
        self.router_bias = nn.Parameter(torch.zeros(layer.num_experts), requires_grad=False)
        self.shared = Expert(h, spec.extra["shared_expert_intermediate_size"])
        self.scaling = spec.extra["routed_scaling"]
        self.softcap = spec.extra["router_softcap"]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(h).float()
        if self.softcap > 0.0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = torch.sigmoid(logits)
        _, ids = torch.topk(scores + self.router_bias.float(), self.top_k, dim=-1)
        weights = scores.gather(-1, ids)
        # renormalised, then rounded to the serving dtype as transformers rounds them
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype).float(), ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shared = self.shared.down_proj(self.act(self.shared.gate_up_proj(h)))
        routed = self.combine(h, *self.route(h))
        return routed * self.scaling + shared if self.scaling != 1.0 else routed + shared


class LagunaDecoderLayer(DecoderLayer):
    """The shared layer plus the softplus output gate on the attention output, and Laguna's
    experts in place of the base's. The gate is computed from the same normed input the qkv
    projection reads and applied to what o_proj reads, so both hook `_project` (the base's
    forward, with its tensor-parallel path, stays the one forward)."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, idx: int) -> None:
        super().__init__(spec, layer, idx)
        self.per_head = spec.extra["output_gate"] == "head"
        rows = layer.num_heads if self.per_head else self.q_dim
        # none where tensor parallelism put this layer's heads on other ranks
        self.g_proj = Linear(spec.hidden_size, rows) if self.q_dim else None
        if layer.num_experts:
            self.moe = LagunaMoE(spec, layer, self.act)
        self._gate: torch.Tensor | None = None  # this forward's gate, from qkv's input to o's

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name == "qkv_proj":
            assert self.g_proj is not None
            # softplus in float32, then the serving dtype, as transformers computes it
            self._gate = F.softplus(self.g_proj(x).float()).to(x.dtype)
        elif name == "o_proj":
            gate, self._gate = self._gate, None
            assert gate is not None
            if self.per_head:
                t, d = x.shape[0], self.layer.head_dim
                x = (x.view(t, -1, d) * gate.unsqueeze(-1)).view(t, -1)
            else:
                x = x * gate
        return super()._project(name, x)


class LagunaForCausalLM(LlamaForCausalLM):
    layer_class = LagunaDecoderLayer

    def __init__(self, spec: ModelSpec, vocab_rows: tuple[int, int] | None = None) -> None:
        super().__init__(spec, vocab_rows)
        # the rotary tables again, each layer type with its own rotated share of the head
        # (the shared decoder has one share for all); keys stay (head_dim, windowed)
        with torch.device("cpu"):
            self._inv_freq = {key: laguna_rope(spec, *key) for key in self._inv_freq}


def laguna_rope(spec: ModelSpec, head_dim: int, local: bool) -> torch.Tensor:
    """Inverse frequencies over a layer type's rotated dimensions, with its own base."""
    share = spec.extra["sliding_rotary" if local else "full_rotary"]
    rotary = int(head_dim * share)
    theta = spec.local_rope_theta if local else spec.rope_theta
    assert theta is not None
    return rope_inv_freq(rotary, theta, None)
