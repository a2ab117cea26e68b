"""Gemma 4's text decoder (`Gemma4ForCausalLM`, model_type "gemma4_text", and the language model
of a `Gemma4ForConditionalGeneration`) as a variation of the Llama decoder (models/llama.py).

What it shares with Gemma 3, as `ModelSpec` fields the shared decoder honours: sqrt(hidden)-scaled
embeddings, sandwich norms, q/k norms, GeGLU, sliding layers with their own rope base interleaved
with global ones, a tied head, final logit soft-capping. Unlike Gemma 3, its norms multiply by `w`
itself (no `1 +` to fold). What is new:

- **KV shared across layers, stored once.** The last `num_kv_shared_layers` layers ("reuse") read
  the K/V of the last earlier layer of their attention type ("store"): they point at its KV group,
  so the pool, the banner's KV/token, the tiers and the prefix hashes count that group once.
- **Two head geometries.** Global layers have their own head_dim (and, with `attention_k_eq_v`,
  their own KV head count), so sliding and global groups have different shapes; global layers
  rotate with "proportional" rope (a quarter of the frequencies, over the whole head).
- **Values from the keys' projection** on global layers where `attention_k_eq_v`: no v rows; V is
  stored beside K all the same, because what attention reads differs (K is k-normed and rotated,
  V is normed without a weight and not rotated). One tensor would do only by storing the raw
  projection and norming and rotating K at every read.
- Every layer's V is RMS-normed without a weight (`v_norm`); the softmax scale is 1.
- **Per-layer inputs** (`hidden_size_per_layer_input`): a second embedding table gives each token a
  small vector per layer, mixed with a projection of its embedding; each layer gates it into the
  residual stream after its FFN. Then the whole stream is multiplied by the layer's `layer_scalar`.
- **Experts beside the dense MLP** (`enable_moe_block`): the dense MLP's output and the experts'
  (routed on the un-normed stream, with a learnt scale per expert) are normed and summed.
- **Double-wide MLP** on the reuse layers where `use_double_wide_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from models.attention_step import AttentionStep
from models.checkpoint import Part
from models.hf_names import HF_ATTENTION_NAMES, HF_MLP_NAMES, LayerNames
from models.layers import RMSNorm, rms_norm
from models.linear.layer import Linear
from models.llama import DecoderLayer, LlamaForCausalLM
from models.moe import MoE
from models.spec import LayerSpec, ModelSpec, hf_model_spec

ARCH = "Gemma4ForCausalLM"
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}
# the ungated activations of the per-layer input gate (the FFN's are GATED_ACTIVATIONS)
_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def layer_types(cfg: dict) -> list[str]:
    """Each layer's attention type, as transformers settles it: 5 sliding to 1 global by
    default, and the last layer always global."""
    n = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or [])
    if not types:
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    types[-1] = "full_attention"
    return types


def kv_owners(types: list[str], shared: int) -> list[int]:
    """The layer whose KV each layer reads: itself, or for the last `shared` layers ("reuse")
    the last layer before them of the same type ("store"), as transformers' `kv_sharing_modes`."""
    n = len(types)
    if not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers={shared} must be below num_hidden_layers={n}")
    first = n - shared
    owners = list(range(n))
    for i in range(first, n):
        stores = [j for j in range(first) if types[j] == types[i]]
        if not stores:
            raise ValueError(f"layer {i} ({types[i]}) shares KV, but no earlier layer has its type")
        owners[i] = stores[-1]
    return owners


def gemma4_spec(cfg: dict, eos: tuple[int, ...]) -> ModelSpec:
    """The geometry of a Gemma 4 text config (a `text_config` already merged in)."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma 4 with bidirectional attention on every token is not a decoder")
    if cfg.get("attention_bias"):
        raise ValueError("Gemma 4 with attention biases is not supported")
    n, types = cfg["num_hidden_layers"], layer_types(cfg)
    overrides = _per_layer_overrides(cfg, types)
    owners = kv_owners(types, cfg.get("num_kv_shared_layers") or 0)
    group_of = {o: g for g, o in enumerate(sorted(set(owners)))}
    moe = bool(cfg.get("enable_moe_block"))
    experts = (cfg["num_experts"], cfg["top_k_experts"]) if moe else (0, 0)
    layers = []
    for i in range(n):
        reuse = owners[i] != i
        wide = 2 if cfg.get("use_double_wide_mlp") and reuse else 1
        layers.append(
            LayerSpec(
                num_heads=cfg["num_attention_heads"],
                num_kv_heads=overrides[i].get("num_key_value_heads", cfg["num_key_value_heads"]),
                head_dim=overrides[i].get("head_dim", cfg["head_dim"]),
                intermediate_size=cfg["intermediate_size"]
                * wide,  # the dense MLP's, experts or not
                kv_group=group_of[owners[i]],
                num_experts=experts[0],
                num_experts_per_tok=experts[1],
                k_eq_v=bool(cfg.get("attention_k_eq_v")) and types[i] == "full_attention",
            )
        )
    rope = {**_DEFAULT_ROPE, **(cfg.get("rope_parameters") or {})}
    full, local = rope["full_attention"], rope["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 4 sliding-layer rope {local['rope_type']!r} is not supported")
    return hf_model_spec(
        ARCH,
        cfg,
        layers,
        rope_theta=float(full["rope_theta"]),
        rope_scaling=dict(full) if full.get("rope_type", "default") != "default" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        v_norm=True,
        hidden_act=cfg.get("hidden_activation") or "gelu_pytorch_tanh",
        eos_token_ids=eos,
        sliding_window=cfg.get("sliding_window"),
        full_attention_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        local_rope_theta=float(local["rope_theta"]),
        embedding_multiplier=cfg["hidden_size"] ** 0.5,
        sandwich_norms=True,
        attention_scale=1.0,  # q and k are RMS-normed: no 1/sqrt(head_dim)
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        extra={
            "per_layer_input": cfg.get("hidden_size_per_layer_input") or 0,
            "per_layer_vocab": cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"],
            "moe_intermediate_size": cfg.get("moe_intermediate_size") or 0,
            "image_fill_id": cfg.get("pad_token_id") or 0,  # what an image's rows read as
        },
    )


def _per_layer_overrides(cfg: dict, types: list[str]) -> list[dict]:
    """Each layer's head_dim / num_key_value_heads overrides: `per_layer_config` where the config
    has one (transformers 5.24 writes it), else the global layers' `global_head_dim` and, with
    `attention_k_eq_v`, `num_global_key_value_heads` (the fields it is derived from)."""
    n = len(types)
    given = cfg.get("per_layer_config")
    if given is None:
        full: dict = {"head_dim": cfg.get("global_head_dim") or 512}
        if cfg.get("attention_k_eq_v", True) and cfg.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        return [dict(full) if t == "full_attention" else {} for t in types]
    out: list[dict] = [{} for _ in range(n)]
    for key, fields in given.items():
        unknown = set(fields) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise ValueError(f"Gemma 4 per_layer_config sets {sorted(unknown)}: not supported")
        out[int(key)] = dict(fields)
    return out


# ---- checkpoint names ---------------------------------------------------------------------------

# HF names under "model.layers.N." -> (the model's name under "layers.N.", part of a fused one).
# HF's `post_attention_layernorm` is the norm *on* the attention output; the decoder's own is the
# FFN's input norm (Llama's meaning), HF's `pre_feedforward_layernorm`.
_LAYER_NAMES: LayerNames = {
    **HF_ATTENTION_NAMES,
    **HF_MLP_NAMES,
    "post_attention_layernorm.weight": ("attn_output_norm.weight", None),
    "pre_feedforward_layernorm.weight": ("post_attention_layernorm.weight", None),
    "post_feedforward_layernorm.weight": ("ffn_output_norm.weight", None),
    "layer_scalar": ("layer_scalar", None),
    "per_layer_input_gate.weight": ("per_layer_input_gate.weight", None),
    "per_layer_projection.weight": ("per_layer_projection.weight", None),
    "post_per_layer_input_norm.weight": ("post_per_layer_input_norm.weight", None),
    "post_feedforward_layernorm_1.weight": ("mlp_output_norm.weight", None),
    "pre_feedforward_layernorm_2.weight": ("moe.input_norm.weight", None),
    "post_feedforward_layernorm_2.weight": ("moe.output_norm.weight", None),
    "router.proj.weight": ("moe.router.weight", None),
    "router.scale": ("moe.router_scale", None),
    "router.per_expert_scale": ("moe.per_expert_scale", None),
}
_TOP_NAMES = (
    "embed_tokens.weight",
    "embed_tokens_per_layer.weight",
    "norm.weight",
    "per_layer_model_projection.weight",
    "per_layer_projection_norm.weight",
)
# a ConditionalGeneration's towers and their projections into the text model: not served
_OTHER_TOWERS = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)


def gemma4_weights(weights: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec) -> Iterator[Part]:
    """HF Gemma 4 tensors under the model's names with their part of a fused parameter
    (`fuse_parts` joins them); the experts' stacked [E, rows, cols] tensors one expert each.
    A reuse layer's k/v projections and k norm, which a checkpoint may carry, are dropped."""
    for name, t in weights:
        if name.startswith("model.language_model."):  # a ConditionalGeneration's text model
            name = "model." + name[len("model.language_model.") :]
        if name.startswith(_OTHER_TOWERS):
            continue
        if name == "lm_head.weight" or name.removeprefix("model.") in _TOP_NAMES:
            yield name.removeprefix("model."), None, t
            continue
        if not name.startswith("model.layers."):
            raise ValueError(f"unexpected tensor {name}")
        idx, rest = name[len("model.layers.") :].split(".", 1)
        i = int(idx)
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            for e in range(t.shape[0]):
                yield f"layers.{i}.moe.experts.{e}.{rest.split('.')[1]}.weight", None, t[e]
            continue
        if rest not in _LAYER_NAMES:
            raise ValueError(f"unexpected tensor {name}")
        own, part = _LAYER_NAMES[rest]
        reuse = spec.kv_group_owner(spec.layers[i].kv_group) != i
        if reuse and rest.startswith(("self_attn.k_", "self_attn.v_")):
            continue
        yield f"layers.{i}.{own}", part, t


# ---- the model ----------------------------------------------------------------------------------


class Gemma4MoE(MoE):
    """Experts beside the dense MLP: routed on the un-normed stream (RMS-normed without a
    weight, times a learnt scale and 1/sqrt(hidden)), top-k renormalised then multiplied by a
    learnt scale per expert; the experts multiply their own normed input and their sum is normed."""

    def __init__(
        self,
        hidden: int,
        layer: LayerSpec,
        act: Callable[[torch.Tensor], torch.Tensor],
        eps: float,
    ) -> None:
        super().__init__(hidden, layer, True, act)
        self.router_scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(layer.num_experts), requires_grad=False)
        self.input_norm = RMSNorm(hidden, eps)
        self.output_norm = RMSNorm(hidden, eps)
        self.eps, self.root = eps, hidden**-0.5

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = rms_norm(h, None, self.eps) * self.router_scale * self.root  # HF's order of products
        weights, ids = super().route(x)
        return weights * self.per_expert_scale[ids].float(), ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """`h`: the stream before the FFN's norm (what the router reads)."""
        weights, ids = self.route(h)
        return self.output_norm(self.combine(self.input_norm(h), weights, ids))


class Gemma4DecoderLayer(DecoderLayer):
    """The shared layer (attention, sandwich norms, dense GeGLU) plus Gemma 4's experts beside
    the dense MLP, its per-layer input gate and its layer scalar. It returns the whole stream
    with no residual: the scalar multiplies the sum, so the sum cannot stay deferred."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, idx: int) -> None:
        # the base builds the dense MLP (experts would replace it there); ours go beside it
        super().__init__(spec, replace(layer, num_experts=0, num_experts_per_tok=0), idx)
        self.layer = layer
        h, eps = spec.hidden_size, spec.rms_norm_eps
        if not self.writes_kv:
            self.k_norm = None  # a reuse layer projects no keys
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.per_layer_width = spec.extra.get("per_layer_input") or 0
        if self.per_layer_width:
            self.per_layer_input_gate = Linear(h, self.per_layer_width)
            self.per_layer_projection = Linear(self.per_layer_width, h)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
            self.gate_act = _ACTIVATIONS[spec.hidden_act]
        if layer.num_experts:
            experts = replace(layer, intermediate_size=spec.extra["moe_intermediate_size"])
            self.moe = Gemma4MoE(h, experts, self.act, eps)
            self.mlp_output_norm = RMSNorm(h, eps)

    def _ffn(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self._dense(h)
        if self.moe is None:
            return out
        return self.mlp_output_norm(out) + self.moe(residual)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionStep,
        per_layer_input: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        out, residual = super().forward(x, residual, cos, sin, attn)
        stream = residual + out
        if per_layer_input is not None:
            gated = self.gate_act(self.per_layer_input_gate(stream)) * per_layer_input
            stream = stream + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return stream * self.layer_scalar, None


class Gemma4ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma4DecoderLayer

    def __init__(self, spec: ModelSpec, vocab_rows: tuple[int, int] | None = None) -> None:
        super().__init__(spec, vocab_rows)
        self.per_layer_width = width = spec.extra.get("per_layer_input") or 0
        if width:
            rows, n = spec.extra["per_layer_vocab"], spec.num_layers
            # all layers' vectors in one row per token ([tokens, layers * width]), as stored
            weight = torch.empty(rows, n * width)  # (not Embedding's random init: see Llama's)
            self.embed_tokens_per_layer = nn.Embedding(rows, n * width, _weight=weight)
            self.embed_tokens_per_layer.weight.requires_grad_(False)
            self.per_layer_model_projection = Linear(spec.hidden_size, n * width)
            self.per_layer_projection_norm = RMSNorm(width, spec.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """(token's own vectors * sqrt(width) + normed projection of its scaled embedding
        `x` / sqrt(hidden)) / sqrt(2), per layer: [tokens, layers, width]."""
        width = self.per_layer_width
        if not width:
            return None
        t, n = x.shape[0], self.spec.num_layers
        # in the serving dtype, as transformers' scaled embedding rounds its factor
        own = self.embed_tokens_per_layer(input_ids) * torch.tensor(width**0.5, dtype=x.dtype)
        mixed = self.per_layer_model_projection(x) * self.spec.hidden_size**-0.5
        mixed = self.per_layer_projection_norm(mixed.view(t, n, width))
        return (mixed + own.view(t, n, width)) * 2**-0.5
