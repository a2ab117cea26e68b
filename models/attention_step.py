"""The one interface between a model and attention: `AttentionStep`.

It lives in models/ because the model calls it and models must not import the engine; the
engine's backends (engine/attention) subclass it, and anything else with a matching `forward`
(the EAGLE trainer's packed causal attention, a test's reference) satisfies it structurally.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol

import torch


class AttentionStep(Protocol):
    """Attention for one engine step, planned by a backend from the step's batch metadata."""

    @abstractmethod
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim], written to the
        layer's KV group before attending; None for a layer that reads a group another layer
        wrote (cross-layer KV sharing). Returns like q."""

    def rope_decode(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor | None:
        """Optional fused path for a step of decode rows only, in a layer that writes its own KV
        and has no q/k norms: rotary on the q and k heads of the fused projection `qkv` (q heads,
        k heads, v heads), k and v written, attention; [tokens, heads, head_dim]. None where the
        step has no such path: the caller runs the general one."""
        return None
