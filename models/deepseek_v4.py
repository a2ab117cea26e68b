"""DeepSeek V4 (`DeepseekV4ForCausalLM`) as transformers 5.24's `models/deepseek_v4` defines it.

Not a variation of the Llama decoder: its residual is `hc_mult` parallel streams mixed by
manifold-constrained hyper-connections (Sinkhorn-normalised), its attention is a shared-KV MQA
head over a sliding window plus compressed entries (models/deepseek_v4_attention.py), and its FFN
is a hash-routed or top-k routed mixture of clamped SwiGLU experts beside a shared expert.

KV groups (`ModelSpec.group_specs`, built here): every layer's window keys (K is V, one plane);
on a CSA layer its compressor's per-token rows (the carry-over for the windows not yet closed,
kept only over the window) and its compressed entries beside the indexer's keys (one per m
tokens); on an HCA layer its rows and entries (one per m' tokens). `layer_groups` in the spec's
`extra` maps a layer to its groups."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models.attention_step import AttentionStep
from models.checkpoint import copy_named, refuse_missing
from models.deepseek_v4_attention import CSA, HCA, SLIDING, V4Attention, rms
from models.deepseek_v4_load import v4_ropes
from models.deepseek_v4_mix import HyperConnection
from models.deepseek_v4_plan import V4Batch
from models.fp8_weights import fp8_format
from models.spec import KVGroupSpec, LayerSpec, ModelSpec, hf_model_spec

ARCH = "DeepseekV4ForCausalLM"
_LEGACY_RATE = {0: SLIDING, 4: CSA, 128: HCA}


def deepseek_v4_spec(cfg: dict, eos: tuple[int, ...]) -> ModelSpec:
    """The geometry of a V4 config with transformers' defaults; ValueError, with the reason,
    for what kvserve does not serve."""
    n = cfg["num_hidden_layers"]
    rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        types = [_LEGACY_RATE[r] for r in cfg["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        hashed = cfg.get("num_hash_layers", 3)
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    types, mlp_types = list(types)[:n], list(mlp_types)[:n]
    if cfg.get("num_key_value_heads", 1) != 1:
        raise ValueError("DeepSeek V4 has one shared KV head (num_key_value_heads 1)")
    if cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ValueError(f"DeepSeek V4 router scoring {cfg['scoring_func']!r} is not supported")
    window, hd = cfg.get("sliding_window", 128), cfg.get("head_dim", 512)
    heads = cfg.get("num_attention_heads", 64)
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        factor = cfg["qk_rope_head_dim"] / hd if cfg.get("qk_rope_head_dim") else 64 / 512
    ropes = v4_ropes(cfg, float(factor))
    fp8 = fp8_format(cfg)  # FP8 block-quantized files are served dequantized; others refused
    idx_dim = cfg.get("index_head_dim", 128)
    groups: list[KVGroupSpec] = []
    layer_groups: list[tuple[int, ...]] = []
    layers = []
    for i in range(n):
        own = [len(groups)]
        groups.append(KVGroupSpec(1, 1, hd, 1, True, "window"))
        if types[i] != SLIDING:
            m = rates[types[i]]
            # the compressor's rows: kv and gate (two series each on CSA), the indexer's too;
            # windowed only where the window covers every row a closing window reads
            csa = types[i] == CSA
            width = (4 * hd + 4 * idx_dim) if csa else 2 * hd
            reach = 2 * m if csa else m
            own.append(len(groups))
            groups.append(KVGroupSpec(1, 1, width, 1, reach <= window, "rows"))
            own.append(len(groups))
            groups.append(
                KVGroupSpec(1, 1, hd + (idx_dim if csa else 0), m, False, "csa" if csa else "hca")
            )
        layer_groups.append(tuple(own))
        layers.append(
            LayerSpec(
                heads,
                1,
                hd,
                cfg.get("moe_intermediate_size", 2048),
                own[0],
                cfg.get("n_routed_experts", 256),
                cfg.get("num_experts_per_tok", 6),
            )
        )
    return hf_model_spec(
        ARCH,
        cfg,
        layers,
        rope_theta=ropes["main"][0],
        rope_scaling=ropes["main"][1],
        max_position_embeddings=cfg.get("max_position_embeddings", 1 << 20),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos,
        sliding_window=window,
        partial_rotary_factor=float(factor),
        group_specs=tuple(groups),
        extra={
            "layer_types": tuple(types),
            "mlp_layer_types": tuple(mlp_types),
            "layer_groups": tuple(layer_groups),
            "compress_rates": {CSA: rates[CSA], HCA: rates[HCA]},
            "ropes": ropes,
            "fp8": fp8,
            "q_lora_rank": cfg.get("q_lora_rank", 1024),
            "o_groups": cfg.get("o_groups", 8),
            "o_lora_rank": cfg.get("o_lora_rank", 1024),
            "index_n_heads": cfg.get("index_n_heads", 64),
            "index_head_dim": idx_dim,
            "index_topk": cfg.get("index_topk", 512),
            "hc_mult": cfg.get("hc_mult", 4),
            "hc_sinkhorn_iters": cfg.get("hc_sinkhorn_iters", 20),
            "hc_eps": cfg.get("hc_eps", 1e-6),
            "swiglu_limit": float(cfg.get("swiglu_limit", 10.0)),
            "routed_scaling": float(cfg.get("routed_scaling_factor", 1.5)),
            "shared_expert_intermediate_size": cfg.get("moe_intermediate_size", 2048),
        },
    )


# ---- the model ----------------------------------------------------------------------------------


class V4MoE(nn.Module):
    """Clamped SwiGLU experts, chosen by a frozen token -> experts table (`hash_moe` layers) or
    by the top k of sqrt(softplus) scores plus a selection bias, weighted by their scores
    renormalised and scaled; plus a shared expert every token goes through."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, hashed: bool) -> None:
        super().__init__()
        d, e, inter = spec.hidden_size, layer.num_experts, layer.intermediate_size
        self.hashed, self.top_k = hashed, layer.num_experts_per_tok
        self.limit, self.scaling = spec.extra["swiglu_limit"], spec.extra["routed_scaling"]
        self.router = nn.Linear(d, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * inter, d))
        self.down = nn.Parameter(torch.empty(e, d, inter))
        shared = spec.extra["shared_expert_intermediate_size"]
        self.shared_gate_up = nn.Linear(d, 2 * shared, bias=False)
        self.shared_down = nn.Linear(shared, d, bias=False)
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(spec.vocab_size, self.top_k, dtype=torch.long)
            )
        else:
            self.router_bias = nn.Parameter(torch.zeros(e), requires_grad=False)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        scores = F.softplus(self.router(h)).sqrt()
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.router_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        if h.shape[0] == 1:  # one decode row: its experts without the grouping ops, in the
            return self._one_row(h, ids[0].tolist(), weights[0])  # loop's order
        out = torch.zeros_like(h)
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            y = F.linear(self.swiglu(F.linear(h[rows], self.gate_up[e])), self.down[e])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out + self.shared_down(self.swiglu(self.shared_gate_up(h)))

    def _one_row(self, h: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
        """`forward` of one row: its experts in ascending order (a hash table's repeat of an
        expert in slot order), each added as the loop's index_add_ adds it."""
        out: torch.Tensor | None = None
        done: dict[int, torch.Tensor] = {}
        for e, slot in sorted((e, slot) for slot, e in enumerate(ids)):
            if e not in done:
                done[e] = F.linear(self.swiglu(F.linear(h, self.gate_up[e])), self.down[e])
            y = done[e] * weights[slot : slot + 1]
            out = y if out is None else out + y
        assert out is not None
        return out + self.shared_down(self.swiglu(self.shared_gate_up(h)))


class V4Layer(nn.Module):
    def __init__(self, spec: ModelSpec, idx: int) -> None:
        super().__init__()
        d, n = spec.hidden_size, spec.extra["hc_mult"]
        self.eps = spec.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.empty(d))
        self.ffn_norm = nn.Parameter(torch.empty(d))
        self.attn_hc = HyperConnection(spec, (2 + n) * n)
        self.ffn_hc = HyperConnection(spec, (2 + n) * n)
        self.attn = V4Attention(spec, idx)
        self.ffn = V4MoE(spec, spec.layers[idx], spec.extra["mlp_layer_types"][idx] == "hash_moe")

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, batch: V4Batch
    ) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        out = self.attn(rms(x, self.attn_norm, self.eps), batch)
        streams = self.attn_hc.expand(out, streams, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.ffn(rms(x, self.ffn_norm, self.eps), input_ids)
        return self.ffn_hc.expand(out, streams, post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, vocab_rows: tuple[int, int] | None = None) -> None:
        super().__init__()
        if vocab_rows not in (None, (0, spec.vocab_size)):
            raise ValueError("DeepSeek V4 under tensor parallelism is not supported")
        self.spec = spec
        self.vocab_rows = (0, spec.vocab_size)
        weight = torch.empty(spec.vocab_size, spec.hidden_size)  # the checkpoint fills it
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=weight)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(V4Layer(spec, i) for i in range(spec.num_layers))
        self.hc_head = HyperConnection(spec, spec.extra["hc_mult"])
        self.norm = nn.Parameter(torch.empty(spec.hidden_size))
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionStep,
        aux_layers: tuple[int, ...] = (),
        lora: object | None = None,
        images: object | None = None,
    ) -> torch.Tensor:
        if aux_layers or lora or images is not None:
            raise ValueError("DeepSeek V4 takes no draft-head layers, LoRA adapters or images")
        paged = attn.paged_batch()
        if paged is None:
            raise ValueError(f"{type(attn).__name__} does not serve compressed attention")
        batch = V4Batch(self.spec, paged, positions)
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.spec.extra["hc_mult"], -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, batch)
        return rms(self.hc_head.head(streams), self.norm, self.spec.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def set_reduce(self, reduce: object) -> None:
        if reduce is not None:
            raise ValueError("DeepSeek V4 under tensor parallelism is not supported")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in `state_dict()` into the model; raises on a name or shape
        the model does not have, or if a weight never arrived."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        seen = copy_named(params, weights, self.spec.tie_word_embeddings)
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            seen.add("lm_head.weight")
        refuse_missing(set(params) - seen)
