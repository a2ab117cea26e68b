"""A mixture-of-experts FFN (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and
each expert active in the step multiplies only its own tokens.

The experts are ordinary `Linear` pairs, so every weight format a dense FFN has serves them too:
oneDNN-packed float, int8, or a GGUF file's blocks multiplied as stored (a GGUF's stacked 3-D
expert tensor is one 2-D block matrix per expert). A step reads the weights of the experts its
tokens chose and no others: batch-1 decode touches k of the E experts' bytes.

Routing, as both configs define it: softmax over all experts' logits in float32, the top k, and
(Mixtral always, Qwen3-MoE with `norm_topk_prob`) those k weights renormalised to sum to 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.linear.layer import Linear
from models.spec import LayerSpec


class Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        layer: LayerSpec,
        renormalize: bool,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.router = Linear(hidden, layer.num_experts)
        self.experts = nn.ModuleList(
            Expert(hidden, layer.intermediate_size) for _ in range(layer.num_experts)
        )
        self.top_k = layer.num_experts_per_tok
        self.renormalize = renormalize
        self.act = act

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] float32, expert ids [tokens, k]) of each token's chosen experts."""
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.combine(h, *self.route(h))

    def combine(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts' outputs on `h`, weighted and summed per token (apart from
        `route`: Gemma 4 routes on another tensor than the experts multiply)."""
        if h.shape[0] == 1:  # a single decode row: its k experts, summed (no grouping ops),
            out = None  # in expert order, as the grouped path below adds them
            for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())):
                expert = self.experts[e]
                y = expert.down_proj(self.act(expert.gate_up_proj(h))).float() * w
                out = y if out is None else out + y
            assert out is not None
            return out.to(h.dtype)
        flat = ids.flatten()
        # (token, choice) pairs grouped by expert: one matmul per expert the step touches
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order]
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            expert = self.experts[e]
            y = expert.down_proj(self.act(expert.gate_up_proj(h.index_select(0, rows))))
            out.index_add_(0, rows, y.float() * pair_weights[start : start + n, None])
            start += n
        return out.to(h.dtype)
