"""DeepSeek V4's manifold-constrained hyper-connections (mHC): the residual is `hc_mult` parallel
streams; before a block they are collapsed into its input (pre), after it the block's output is
expanded into them (post) and they are mixed by a doubly stochastic matrix (comb, projected by
Sinkhorn-Knopp), all in float32 as transformers' `DeepseekV4HyperConnection` computes it.

Two forms of the same arithmetic: the PyTorch ops here (the reference: ~120 small ops a mixing,
the Sinkhorn iterations over [rows, n, n]) and kvserve's C++ ops (kernels/deepseek_v4.cpp's
`hc_pre`/`hc_post`, float32 streams). Which one serves is measured at startup per geometry
(engine/build/deepseek_v4_choice.py) and set on each module (`fused`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import DEEPSEEK_V4
from models.deepseek_v4_attention import rms
from models.spec import ModelSpec


def fused_ops():  # -> the compiled ops, or None
    """kvserve's V4 C++ ops (kernels/deepseek_v4.cpp), or None where they cannot be built."""
    return DEEPSEEK_V4.load()


def fused_refusal(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the C++ ops cannot serve streams of `dtype` on `device`, or None."""
    if device.type != "cpu":
        return f"the C++ ops run on CPU (this is {device.type})"
    if dtype != torch.float32:
        return f"the C++ ops take float32 ({dtype} serves)"
    if fused_ops() is None:
        return "kvserve's C++ ops are not built here (no compiler, or KVSERVE_NO_CPP=1)"
    return None


class HyperConnection(nn.Module):
    """The mHC weights of a block: collapse the streams (pre), expand the block's output (post)
    and mix the streams (comb, projected to doubly stochastic by Sinkhorn-Knopp), float32.
    `fused`: the C++ ops serve `forward` and `expand` (set by the startup measurement)."""

    def __init__(self, spec: ModelSpec, outputs: int) -> None:
        super().__init__()
        n, x = spec.extra["hc_mult"], spec.extra
        self.hc, self.iters, self.eps, self.norm_eps = (
            n,
            x["hc_sinkhorn_iters"],
            x["hc_eps"],
            (spec.rms_norm_eps),
        )
        self.fn = nn.Parameter(torch.empty(outputs, n * spec.hidden_size))
        self.base = nn.Parameter(torch.empty(outputs))
        self.scale = nn.Parameter(torch.empty(3 if outputs > n else 1))
        self.fused = False

    def mix(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms(streams.flatten(1).float(), None, self.norm_eps)
        return F.linear(flat, self.fn.float())

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(post [T, n], comb [T, n, n], collapsed [T, D]) of streams [T, n, D]."""
        if self.fused:
            return fused_ops().hc_pre(
                streams.contiguous(),
                self.fn,
                self.base,
                self.scale,
                self.iters,
                self.eps,
                self.norm_eps,
            )
        hc, mixes = self.hc, self.mix(streams)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * s_comb + comb_b.view(hc, hc), -1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    def expand(
        self, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after the block: its output `out` [T, D] expanded by `post`, plus the
        streams mixed by `comb` (new_j = post_j out + sum_i comb_ij streams_i)."""
        if self.fused:
            return fused_ops().hc_post(out.contiguous(), streams, post, comb)
        post, comb = post.to(streams.dtype), comb.to(streams.dtype)  # as transformers mixes
        return post.unsqueeze(-1) * out.unsqueeze(-2) + comb.transpose(-1, -2) @ streams

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """The final collapse of the streams (transformers' `hc_head`)."""
        pre = torch.sigmoid(self.mix(streams) * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
