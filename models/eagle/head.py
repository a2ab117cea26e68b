"""EAGLE draft heads in the two published layouts, riding on the target's hidden states.

EAGLE-1/2 ("eagle1"): x = fc([embed(token_{p+1}) ; feature_p]) (2H -> H), then one Llama decoder
layer without an input norm; its output is the predicted feature of position p+1, which goes
through the target's lm_head (or a row subset of it, `token_map`) and is fed back as the next
feature when drafting a chain.

EAGLE-3 ("eagle3"): the first step's feature is fc([low ; mid ; high]) over three target layers
(3H -> H); later steps feed back the layer's pre-norm output. The layer ("midlayer") attends over
[input_layernorm(embed) ; hidden_norm(x)] (2H wide), then a final `norm` and the head's own
reduced-vocab `lm_head`, whose rows map to target ids by `d2t` (target = draft + d2t[draft]).

The draft layer keeps its KV in the target's block pool as one extra KV group, so it attends
through the same `AttentionStep` as the target, under layer index `layer_idx`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from torch import nn

from models.attention_step import AttentionStep
from models.layers import (
    RMSNorm,
    add_rms_norm,
    apply_rope,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    silu_mul,
)
from models.linear import gguf_linear
from models.linear.dense import cpu_linear
from models.linear.gguf_linear import GGUFWeight
from models.linear.layer import Linear
from models.llama import LlamaForCausalLM
from models.spec import LayerSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class EagleConfig:
    layout: str  # "eagle1" or "eagle3"
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    fc_bias: bool
    draft_vocab_size: int | None  # eagle3: rows of the head's own lm_head
    aux_layers: tuple[int, ...]  # eagle3: target layers whose inputs feed fc

    def layer_spec(self, kv_group: int) -> LayerSpec:
        return LayerSpec(
            self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size, kv_group
        )

    @staticmethod
    def from_dict(cfg: dict, layout: str, target: ModelSpec, fc_bias: bool) -> EagleConfig:
        hidden = cfg.get("hidden_size", target.hidden_size)
        heads = cfg.get("num_attention_heads", target.layers[-1].num_heads)
        n = target.num_layers
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return EagleConfig(
            layout=layout,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg.get("intermediate_size", target.layers[-1].intermediate_size),
            rms_norm_eps=cfg.get("rms_norm_eps", target.rms_norm_eps),
            rope_theta=cfg.get("rope_theta", target.rope_theta),
            fc_bias=fc_bias,
            draft_vocab_size=cfg.get("draft_vocab_size") if layout == "eagle3" else None,
            aux_layers=tuple(aux) if aux else ((2, n // 2, n - 3) if layout == "eagle3" else ()),
        )


class EagleHead(nn.Module):
    """One draft step for a flat batch of positions. Parameters are plain tensors that do not
    require grad; the trainer (tools/eagle_train.py) switches them on."""

    def __init__(self, cfg: EagleConfig, target: LlamaForCausalLM, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.source = ""  # where it was loaded from (the banner says which head serves)
        h = cfg.hidden_size
        eagle3 = cfg.layout == "eagle3"
        self.fc = Linear((3 if eagle3 else 2) * h, h, bias=cfg.fc_bias)
        attn_in = 2 * h if eagle3 else h
        self.q_dim, self.kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(attn_in, self.q_dim + 2 * self.kv_dim)
        self.o_proj = Linear(self.q_dim, h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, h)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        self.norm = RMSNorm(h, cfg.rms_norm_eps) if eagle3 else None
        vocab = cfg.draft_vocab_size if eagle3 else None
        self.lm_head = Linear(h, vocab) if vocab else None
        # Draft-vocab row -> target token id; None means the full target vocabulary.
        self.register_buffer("token_map", None)
        # Shared with the target, never copied: not registered as parameters of the head.
        self._embed = (target.embed_tokens,)
        self._target_lm_head = (target.lm_head,)
        self.vocab_weight: torch.Tensor | None = None  # eagle1 with token_map: lm_head rows
        # those rows as the target's own GGUF blocks, where it has them (`serve_on_blocks`)
        self.vocab_head: Linear | None = None
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, target.spec.rope_scaling)

    @property
    def embed(self) -> nn.Embedding:
        return self._embed[0]

    def set_token_map(self, token_map: torch.Tensor | None) -> None:
        self.token_map = token_map
        if token_map is not None and self.lm_head is None:
            target = self._target_lm_head[0]  # its weight may be held as GGUF blocks
            method = target.format
            blocks = method.kernel if isinstance(method, GGUFWeight) else None
            weight = target.weight if blocks is None else blocks.dequantized(torch.float32)
            weight = weight.to(self.embed.weight.dtype)
            self.vocab_weight = weight.index_select(0, token_map.to(weight.device)).contiguous()

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's first-step input from the target's [final ; aux layers] hidden rows."""
        h = self.cfg.hidden_size
        return hidden[:, h:] if self.cfg.layout == "eagle3" else hidden[:, :h]

    def forward(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionStep,
        from_target: bool = True,
    ) -> torch.Tensor:
        """token_ids [T] are the tokens at p+1; features [T, H] (eagle3 from the target:
        [T, 3H]) describe position p. Returns the predicted feature of p+1 [T, H]."""
        emb = self.embed(token_ids)
        cfg, t = self.cfg, token_ids.shape[0]
        if cfg.layout == "eagle1":
            x = self.fc(torch.cat((emb, features), dim=-1))
            attn_in = x
        else:
            x = self.fc(features) if from_target else features
            assert self.input_layernorm is not None and self.hidden_norm is not None
            attn_in = torch.cat((self.input_layernorm(emb), self.hidden_norm(x)), dim=-1)
        qkv = self.qkv_proj(attn_in)
        if self.inv_freq.device != x.device:  # moved once, not uploaded every draft step
            self.inv_freq = self.inv_freq.to(x.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        # a draft chain's step: rotary, KV write and attention in the target's fused decode op
        # where the step has it (a draft step is mostly such small ops: ~0.3 ms of Python)
        o = attn.attend_qkv(self.layer_idx, qkv, cos, sin, cfg.num_heads, decode_only=True)
        if o is None:
            q = qkv[:, : self.q_dim].view(t, cfg.num_heads, cfg.head_dim)
            k = qkv[:, self.q_dim : self.q_dim + self.kv_dim].view(t, -1, cfg.head_dim)
            v = qkv[:, self.q_dim + self.kv_dim :].reshape(t, -1, cfg.head_dim)
            o = attn.forward(self.layer_idx, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        norm = self.post_attention_layernorm
        residual, h = add_rms_norm(self.o_proj(o.reshape(t, self.q_dim)), x, norm.weight, norm.eps)
        return residual + self.down_proj(silu_mul(self.gate_up_proj(h)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [T, draft vocab] (float32); map columns through `token_map`."""
        if self.norm is not None:
            hidden = rms_norm(hidden, self.norm.weight, self.norm.eps)
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.vocab_head is not None:
            return self.vocab_head(hidden).float()
        if self.vocab_weight is None:
            return self._target_lm_head[0](hidden).float()
        return cpu_linear(hidden, self.vocab_weight, None).float()

    def serve_on_blocks(self, target: LlamaForCausalLM) -> str:
        """CPU: the head's linears rounded to Q8_0 blocks on the block kernel, and the draft
        vocabulary's rows taken from `target`'s lm_head blocks where it has them (the same
        values, half the bytes), each up to the rows the target's weights measured the kernel
        faster than the dense path (the builder packs dense copies for more, as the target's).
        A draft step's time is its weights' bytes: in bf16 ~16 MB, ~1 ms beside a ~4 ms target
        step (SmolLM2 here). Drafts only: verification keeps the output the target's. Returns
        what serves, for the banner ("" where the block kernel is not built here)."""
        weight = self.fc.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return ""  # the kernels take float32 or bf16 activations on a CPU
        if gguf_linear.load_q8() is None:
            return ""
        held = gguf_linear.attach(self, gguf_linear.quantize_to_blocks(self, "Q8_0"))
        layers = gguf_linear.weight_groups(target).get("decoder layers")
        for w in gguf_linear.gguf_weights(self) if layers else ():
            w.kernel_max_rows = layers[0].kernel_max_rows  # measured at the target's load
        vocab = ""
        head = target.lm_head.format
        if self.vocab_weight is not None and isinstance(head, GGUFWeight):
            assert self.token_map is not None
            blocks = head.kernel
            self.vocab_head = target.lm_head.rows(self.token_map.to(blocks.blocks.device))
            self.vocab_weight = None
            vocab = (
                f", {len(self.token_map)} vocabulary rows from the target's {blocks.format} blocks"
            )
        size = sum(held.values()) / 2**20
        return f"draft head on Q8_0 blocks ({size:.1f} MiB{vocab})"


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        return load_file(st)
    bin_path = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin")


_LAYER_KEYS = {
    "self_attn.o_proj.weight": "o_proj",
    "mlp.down_proj.weight": "down_proj",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "input_layernorm.weight": "input_layernorm",
    "hidden_norm.weight": "hidden_norm",
}


def load_eagle_head(
    path: str, target: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> EagleHead:
    """Load an EAGLE-1/2 or EAGLE-3 head from a directory (config.json + weights)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg_dict = json.load(f)
    weights = _read_weights(path)
    eagle3 = any(k.startswith("midlayer.") for k in weights)
    prefix = "midlayer." if eagle3 else "layers.0."
    cfg = EagleConfig.from_dict(
        cfg_dict, "eagle3" if eagle3 else "eagle1", target.spec, "fc.bias" in weights
    )
    bad_aux = [i for i in cfg.aux_layers if not 0 <= i < target.spec.num_layers]
    if bad_aux:
        raise ValueError(f"draft head reads target layers {bad_aux}, which the target lacks")
    if cfg.hidden_size != target.spec.hidden_size:
        raise ValueError(
            f"draft head hidden size {cfg.hidden_size} != target's {target.spec.hidden_size}"
        )
    head = EagleHead(cfg, target, layer_idx=target.spec.num_layers)
    inter = cfg.intermediate_size
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"{path}: draft head lacks {name}")
        used.add(name)
        return weights[name].to(torch.float32)

    head.fc.load_rows(0, take("fc.weight"), take("fc.bias") if cfg.fc_bias else None)
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        offset = (0, head.q_dim, head.q_dim + head.kv_dim)[i]
        head.qkv_proj.load_rows(offset, take(f"{prefix}self_attn.{proj}.weight"))
    head.gate_up_proj.load_rows(0, take(f"{prefix}mlp.gate_proj.weight"))
    head.gate_up_proj.load_rows(inter, take(f"{prefix}mlp.up_proj.weight"))
    for key, attr in _LAYER_KEYS.items():
        module = getattr(head, attr)
        if module is None:
            continue  # eagle1 has no input norm on its only layer (a saved one is ignored)
        tensor = take(prefix + key)
        if isinstance(module, Linear):
            module.load_rows(0, tensor)
        else:
            module.weight.data.copy_(tensor)
    token_map = None
    if eagle3:
        assert head.norm is not None and head.lm_head is not None
        head.norm.weight.data.copy_(take("norm.weight"))
        head.lm_head.load_rows(0, take("lm_head.weight"))
        d2t = (
            weights["d2t"].long() if "d2t" in weights else torch.zeros(head.lm_head.weight.shape[0])
        )
        used.add("d2t")
        token_map = torch.arange(len(d2t)) + d2t.long()
    elif "token_map" in weights:
        token_map = weights["token_map"].long()
        used.add("token_map")
    ignored = {"embed_tokens.weight", "t2d", f"{prefix}input_layernorm.weight"}
    unexpected = set(weights) - used - ignored
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors in draft head: {sorted(unexpected)[:4]}")
    head.to(device=device, dtype=dtype)
    head.set_token_map(token_map.to(device) if token_map is not None else None)
    return head
