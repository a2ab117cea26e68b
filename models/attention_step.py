"""The one interface between a model and attention: `AttentionStep`.

It lives in models/ because the model calls it and models must not import the engine; the
engine's backends (engine/attention) subclass it, and anything else with a matching `forward`
(the EAGLE trainer's packed causal attention, a test's reference) satisfies it structurally.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class DecodeStackArgs:
    """What the whole-stack decode op (kernels/decode_stack.cpp) needs from attention:
    each layer's KV cache, the step's slots, block tables and lengths (as `attend_qkv`'s
    decode op takes them)."""

    kv_caches: list[torch.Tensor]
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    window: int


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """The step's flat batch over the paged KV pool, for a model that reads and writes its KV
    groups itself (DeepSeek V4's compressed attention, models/deepseek_v4_attention.py): every
    group's tensor [planes, heads, blocks, entries a block, width], sequence i's query rows
    [query_start[i], + query_lens[i]) from position context_lens[i], its block table, and its
    table into the windowed groups' own pool (None: they use `block_tables`)."""

    kv_caches: list[torch.Tensor]
    block_size: int
    query_start: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    window_block_tables: list[list[int]] | None


class AttentionStep(Protocol):
    """Attention for one engine step, planned by a backend from the step's batch metadata."""

    @abstractmethod
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim], written to the
        layer's KV group before attending; None for a layer that reads a group another layer
        wrote (cross-layer KV sharing). Returns like q."""

    def attend_qkv(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        decode_only: bool = False,
    ) -> torch.Tensor | None:
        """Optional: attention straight from a layer's fused projection `qkv` [tokens, q heads |
        k heads | v heads], for a layer that writes its own KV and whose q and k are plain
        rotary heads (no norms, no extra scale, whole-head rotary): rotary on q and k, k and v
        written into the layer's KV group, attention; [tokens, heads, head_dim]. A backend
        fuses what it can here (the CPU backend: all three in one op for a step of decode rows,
        rotary and the write in one op otherwise); `decode_only`: only the former. None where
        the step has no such path: the caller rotates and calls `forward`."""
        return None

    def paged_batch(self) -> PagedBatch | None:
        """The step's batch over the pool, where this backend serves models that attend over
        their KV groups themselves (compressed and sparse attention); None: it does not."""
        return None

    def decode_stack_args(self, cos: torch.Tensor, num_layers: int) -> DecodeStackArgs | None:
        """Where `attend_qkv`'s one-op decode serves every one of the model's `num_layers` layers,
        what the whole-stack decode op needs; None otherwise."""
        return None
