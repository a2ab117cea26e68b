"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm) and SmolLM
(tied embeddings). Geometry comes from `ModelSpec.layers`, so per-layer head counts and shared KV
groups need no change here.

The forward takes a flat batch of tokens (no padding) with their positions and an attention step
object that owns the KV cache plan; it returns hidden states. Logits are computed separately, only
for the rows that need them.

The model knows only its own parameter names (its `state_dict`): q/k/v are one `qkv_proj`, gate/up
one `gate_up_proj`. Checkpoint formats map their names onto these in their loaders
(models/loader.py, gguf_loader.py, openelm.py; see models/checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from models.attention_step import AttentionStep
from models.checkpoint import copy_named, refuse_missing
from models.layers import (
    GATED_ACTIVATIONS,
    RMSNorm,
    add_rms_norm,
    apply_rope,
    rms_norm,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)
from models.linear.decode_stack import DecodeStack
from models.linear.layer import Linear
from models.lora import LoRARows, StepAdapters, enable_lora
from models.moe import MoE
from models.mrope import mrope_axes, mrope_cos_sin
from models.spec import LayerSpec, ModelSpec


def rope_key(spec: ModelSpec, idx: int) -> tuple[int, bool]:
    """Layers sharing a rotary table: (head_dim, windowed with a local rope base)."""
    head_dim = spec.layers[idx].head_dim
    return head_dim, spec.local_rope_theta is not None and spec.layer_window(idx) is not None


def rope_table(spec: ModelSpec, head_dim: int, local: bool) -> torch.Tensor:
    """Inverse frequencies over the rotated dimensions: a windowed layer's local base
    unscaled (Gemma 3), else the model's base and scaling."""
    rotary = spec.rotary_dim(head_dim)
    if local:
        assert spec.local_rope_theta is not None
        return rope_inv_freq(rotary, spec.local_rope_theta, None)
    return rope_inv_freq(rotary, spec.rope_theta, spec.rope_scaling)


class DecoderLayer(nn.Module):
    """One decoder layer. A layer that shares another layer's KV group (cross-layer KV sharing)
    projects only queries and attends over the KV its group's first layer wrote.

    Under tensor parallelism (models/tp_plan.py) the layer holds this rank's heads and FFN
    columns, `reduce` sums the ranks' partial attention and FFN outputs, and a layer none of
    whose heads are on this rank adds nothing to the first sum."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, idx: int) -> None:
        super().__init__()
        self.idx = idx
        self.layer = layer
        self.eps = spec.rms_norm_eps
        self.writes_kv = spec.kv_group_owner(layer.kv_group) == idx
        h, q_dim = spec.hidden_size, layer.num_heads * layer.head_dim
        kv_dim = layer.num_kv_heads * layer.head_dim if self.writes_kv else 0
        self.q_dim, self.kv_dim = q_dim, kv_dim
        # where V's rows start in qkv: K's own where values are the key projection (k_eq_v)
        self.v_start = q_dim + (0 if layer.k_eq_v else kv_dim)
        self.v_norm = spec.v_norm
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        # no projections at all where tensor parallelism put every head on other ranks
        rows = q_dim + (1 if layer.k_eq_v else 2) * kv_dim
        self.qkv_proj = Linear(h, rows, bias=spec.qkv_bias) if q_dim else None
        self.o_proj = Linear(q_dim, h) if q_dim else None
        self.q_norm = RMSNorm(layer.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(layer.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)  # the FFN's input norm
        # Gemma's sandwich: RMSNorm on the attention output and on the FFN output as well
        self.attn_output_norm = RMSNorm(h, spec.rms_norm_eps) if spec.sandwich_norms else None
        self.ffn_output_norm = RMSNorm(h, spec.rms_norm_eps) if spec.sandwich_norms else None
        if spec.hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {spec.hidden_act!r}")
        self.act = GATED_ACTIVATIONS[spec.hidden_act]
        self.moe = MoE(h, layer, spec.moe_renormalize, self.act) if layer.num_experts else None
        if self.moe is None:
            self.gate_up_proj = Linear(h, 2 * layer.intermediate_size)
            self.down_proj = Linear(layer.intermediate_size, h)
        # q scaled so that the backends' head_dim ** -0.5 gives the model's softmax scale
        scale = spec.attention_scale
        self.q_scale = 1.0 if scale is None else scale * layer.head_dim**0.5
        # q and k plain rotary heads (no norms, no extra scale, whole-head rotary), as
        # `AttentionStep.attend_qkv` takes them
        self.plain_qkv = (
            self.q_norm is None
            and self.writes_kv
            and self.q_scale == 1.0
            and spec.rotary_dim(layer.head_dim) == layer.head_dim
            and not layer.k_eq_v
            and not self.v_norm
        )
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionStep,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual, h = add_rms_norm(x, residual, self.input_layernorm.weight, self.eps)
        if self.q_dim == 0:  # tensor parallel: this layer's heads are all on other ranks
            return self._mlp(x.new_zeros(x.shape), residual)
        qkv = self._project("qkv_proj", h)
        heads = self.layer.num_heads
        # plain rotary q/k: the backend may rotate, write and attend from qkv itself
        o = attn.attend_qkv(self.idx, qkv, cos, sin, heads) if self.plain_qkv else None
        if o is None:
            o = attn.forward(self.idx, *self._rotated_qkv(qkv, cos, sin))
        o = self._project("o_proj", o.reshape(x.shape[0], self.q_dim))
        return self._mlp(o, residual)

    def _rotated_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q, k and v heads of the fused projection, q and k normed (Qwen3) and rotated, q
        scaled; k and v None in a layer that reads another layer's KV."""
        t, lay = qkv.shape[0], self.layer
        k = v = None
        if self.writes_kv:
            v = qkv[:, self.v_start : self.v_start + self.kv_dim]
            v = v.reshape(t, lay.num_kv_heads, lay.head_dim)
            if self.v_norm:
                v = rms_norm(v, None, self.eps)
        if self.q_norm is None and self.writes_kv:
            # q and k heads side by side in qkv: one rotary pass over both (fewer small ops)
            qk = qkv[:, : self.q_dim + self.kv_dim].view(t, -1, lay.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, : lay.num_heads], qk[:, lay.num_heads :]
        else:
            q = qkv[:, : self.q_dim].view(t, lay.num_heads, lay.head_dim)
            if self.q_norm is not None:
                q = self.q_norm(q)
            q = apply_rope(q, cos, sin)
            if self.writes_kv:
                k = qkv[:, self.q_dim : self.q_dim + self.kv_dim].view(
                    t, lay.num_kv_heads, lay.head_dim
                )
                if self.k_norm is not None:
                    k = self.k_norm(k)
                k = apply_rope(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, k, v

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The projection `name` of `x` (a variation's hook: Laguna gates around two)."""
        return getattr(self, name)(x)

    def _mlp(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reduce is not None:
            x = self.reduce(x)
        if self.attn_output_norm is not None:
            x = self.attn_output_norm(x)
        residual, h = add_rms_norm(x, residual, self.post_attention_layernorm.weight, self.eps)
        out = self._ffn(h, residual)
        if self.reduce is not None:
            out = self.reduce(out)
        if self.ffn_output_norm is not None:  # on the whole sum (after tensor parallelism's)
            out = self.ffn_output_norm(out)
        return out, residual

    def _ffn(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The FFN on its normed input `h` (`residual`: the un-normed sum, which Gemma 4's
        router reads)."""
        return self.moe(h) if self.moe is not None else self._dense(h)

    def _dense(self, h: torch.Tensor) -> torch.Tensor:
        gated = self.act(self._project("gate_up_proj", h))
        return self._project("down_proj", gated)


class LlamaForCausalLM(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer  # a variation's own layer (models/gemma4.py)

    def __init__(self, spec: ModelSpec, vocab_rows: tuple[int, int] | None = None) -> None:
        """`vocab_rows` [v0, v1): the lm_head holds (and `compute_logits` gives) only those
        vocabulary rows (a tensor-parallel rank's part); default all."""
        super().__init__()
        self.spec = spec
        self.vocab_rows = vocab_rows or (0, spec.vocab_size)
        # an uninitialised weight (the checkpoint fills it): Embedding's own random init
        # imports torch._dynamo on the meta device, ~1.9 s of every start
        weight = torch.empty(spec.vocab_size, spec.hidden_size)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=weight)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            self.layer_class(spec, lay, i) for i, lay in enumerate(spec.layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, self.vocab_rows[1] - self.vocab_rows[0])
        self.rope_keys = [rope_key(spec, i) for i in range(spec.num_layers)]
        with torch.device("cpu"):  # real values even when the model is built on "meta"
            self._inv_freq = {key: rope_table(spec, *key) for key in sorted(set(self.rope_keys))}
            self.mrope_axes = (
                mrope_axes(spec.mrope_section, spec.mrope_interleaved)
                if spec.mrope_section
                else None
            )
        self.rope_attention_factor = rope_attention_factor(spec.rope_scaling)
        # per device, moved once (not uploaded on every forward: a host->device copy each step)
        self._inv_freq_on: dict[torch.device, dict[int, torch.Tensor]] = {}
        self.decode_stack = DecodeStack()
        # the step's LoRA adapters, read by the projections' LoRA methods (`enable_lora`)
        self.adapters = StepAdapters()

    def inv_freq(self, device: torch.device) -> dict[tuple[int, bool], torch.Tensor]:
        """The rotary inverse frequencies per `rope_key`, on `device` (copied there once)."""
        table = self._inv_freq_on.get(device)
        if table is None:
            table = {d: inv.to(device) for d, inv in self._inv_freq.items()}
            self._inv_freq_on[device] = table
        return table

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionStep,
        aux_layers: tuple[int, ...] = (),
        lora: LoRARows | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]. With `aux_layers` (EAGLE-3),
        the inputs of those layers are concatenated after it: [tokens, hidden * (1 + n)].
        `lora`: LoRA adapters' rows in the step (models/lora.py). `images`: (rows, soft tokens
        [rows, hidden * (1 + k)]): the first `hidden` columns are those rows' embeddings, as
        the image encoder made them (unscaled); the k more (Qwen3-VL's deepstack) are added to
        those rows' hidden states after each of the first k layers."""
        layer_adds: tuple[torch.Tensor, ...] = ()
        if images is not None:  # a placeholder id may lie outside the vocabulary (Gemma 3)
            # Gemma 4's per-layer inputs read the placeholders as its pad token
            input_ids = input_ids.index_fill(0, images[0], self.spec.extra.get("image_fill_id", 0))
        x = self.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:
            # in the serving dtype, as Gemma's own code rounds its sqrt(hidden) normaliser
            x = x * torch.tensor(self.spec.embedding_multiplier, dtype=x.dtype)
        if images is not None:
            soft, *deepstack = images[1].to(x.dtype).split(x.shape[1], dim=1)
            layer_adds = tuple(deepstack)
            x = x.index_copy(0, images[0], soft)
        rope = self.rope(positions, x.device)
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        per_layer = self.per_layer_inputs(input_ids, x)
        plain = not aux_layers and not lora and per_layer is None and images is None
        stacked = self._decode_stack(x, rope, attn) if plain else None
        if stacked is not None:
            x, residual = stacked
        with self.adapters.serving(lora):
            for i, layer in enumerate(self.layers if stacked is None else ()):
                if i in aux_layers:
                    captured[i] = x if residual is None else residual + x
                cos, sin = rope[self.rope_keys[i]]
                extra = () if per_layer is None else (per_layer[:, i],)
                # a layer may hand back its whole sum with no residual (Gemma 4 scales it)
                x, residual = layer(x, residual, cos, sin, attn, *extra)
                if i < len(layer_adds):  # to the layer's output, the residual sum
                    assert images is not None
                    total = x if residual is None else residual + x
                    x, residual = total.index_add(0, images[0], layer_adds[i]), None
        hidden = rms_norm(x if residual is None else residual + x, self.norm.weight, self.norm.eps)
        if not aux_layers:
            return hidden
        return torch.cat([hidden, *(captured[i] for i in aux_layers)], dim=-1)

    def rope(
        self, positions: torch.Tensor, device: torch.device
    ) -> dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin per `rope_key` of the step's positions: [tokens], or M-RoPE's [3, tokens]
        (models/mrope.py; where all three axes agree it equals the plain table)."""
        factor, tables = self.rope_attention_factor, self.inv_freq(device)
        if positions.dim() == 2:
            axes = self.mrope_axes
            assert axes is not None, "three-axis positions need the model's M-RoPE sections"
            return {k: mrope_cos_sin(positions, inv, axes, factor) for k, inv in tables.items()}
        return {k: rope_cos_sin(positions, inv, factor) for k, inv in tables.items()}

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[tokens, layers, width]: an input of each layer's own (Gemma 4's per-layer
        embeddings); None: the layers take none."""
        return None

    def _decode_stack(
        self,
        x: torch.Tensor,
        rope: dict[int, tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionStep,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) of every layer at once where the step and the layers' weights
        allow (models/linear/decode_stack.py); None: the layers run one by one."""
        return self.decode_stack(self.layers, x, rope, attn, self.spec.rms_norm_eps)

    def enable_lora(self) -> None:
        """Serve the decoder's projections with LoRA on top of their methods (models/lora.py),
        once the methods are final: a step's `lora` rows then reach them."""
        enable_lora(self.layers, self.adapters)

    def set_reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Tensor parallelism's all-reduce of partial layer outputs (None: this rank alone)."""
        for layer in self.layers:
            layer.reduce = reduce
        self.decode_stack.forget()  # read again: a reducing layer takes the per-layer path

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in `state_dict()` ("layers.3.qkv_proj.weight", ...) into the
        model. Biases may be absent (they stay zero). With tied embeddings, or without an
        `lm_head.weight`, the head shares the embedding. Raises on a name or shape the model
        does not have, or if a weight never arrived."""
        params = dict(self.named_parameters())
        seen = copy_named(params, weights, self.spec.tie_word_embeddings)
        if self.spec.tie_word_embeddings or "lm_head.weight" not in seen:
            # tied: one tensor, both roles (the head's rows a view of the embedding's)
            v0, v1 = self.vocab_rows
            embedding = self.embed_tokens.weight
            whole = (v0, v1) == (0, self.spec.vocab_size)
            self.lm_head.weight = embedding if whole else nn.Parameter(embedding[v0:v1], False)
            seen.add("lm_head.weight")
        refuse_missing({name for name in params if not name.endswith(".bias")} - seen)
