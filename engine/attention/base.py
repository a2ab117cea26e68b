"""The attention backend interface: plan once per step from the batch metadata, then
`forward(layer, q, k, v)` per layer, which writes the new K/V into their slots and attends.

A plan is an `AttentionStep`, defined once in models/attention_step.py (the model calls it, and
models do not import the engine); it is re-exported here for the engine's modules."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.matrix import DeviceFacts, ModelNeeds, Verdict
from models.attention_step import AttentionStep
from models.spec import ModelSpec

__all__ = ["AttentionBackend", "AttentionStep", "StepMetadata"]


@dataclass(slots=True)
class StepMetadata:
    """Everything a backend needs about one step's flat batch; built once by the model runner.

    Sequence i owns query rows [query_start[i], query_start[i] + query_lens[i]); its first query
    token sits at position context_lens[i]; after the step it holds seq_lens[i] tokens of KV.
    """

    query_start: list[int]
    query_lens: list[int]
    context_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] int64, physical slot of every new token
    # where the sliding-window layers' KV has a pool of its own (engine/kv/window.py): each
    # sequence's table into it (freed blocks behind the window are its null block 0) and the
    # new tokens' slots there; None: those layers use `block_tables` too
    window_block_tables: list[list[int]] | None = None
    window_slot_mapping: torch.Tensor | None = None
    # per sequence, the position ranges [start, end) of the images its chunk computes: their
    # tokens attend to each other in both directions (the rest stays causal); None: no images
    image_spans: list[list[tuple[int, int]]] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def sdpa_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of q [rows, heads, dim] over keys and values [kv heads, seq, dim] (grouped
    query heads), causal where `mask` is None, in torch's SDPA as a batch of one: 4-D, since
    torch's CPU flash-attention kernel takes only 4-D inputs (3-D ones fall back to the unfused
    math path, ~6x slower on a 1,500-token prompt). Returns [rows, heads, dim]."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def paged_layer_cache(
    backend: AttentionBackend,
    layer_idx: int,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
    kv_dim: int,
) -> torch.Tensor:
    """A layer's KV group with the step's new K/V written into their slots, for the page
    layouts whose K and V halves (along `kv_dim`) are [blocks, block_size, kv_heads, head_dim]
    (FlashInfer's, xformers'). k and v are None for a layer reading a shared KV group."""
    cache = backend.kv_caches[backend.layer_group[layer_idx]]
    if k is not None and v is not None:
        cache.select(kv_dim, 0)[slot_block, slot_offset] = k
        cache.select(kv_dim, 1)[slot_block, slot_offset] = v
    return cache


# The KV layout of the CPU backend and the reference (so that an int8 cache is the same rows
# with their scales for both): heads outermost, so one `index_select` of a sequence's pages over
# the block dimension gives [kv_heads, pages * block_size, head_dim], contiguous per head.
HEADS_OUTERMOST = ("kv", "heads", "blocks", "slots", "dim")


class AttentionBackend(ABC):
    """A backend owns the layout of the KV tensors it attends over (`kv_layout`); the pool
    allocates one tensor per KV group in that layout (`kv_cache_shape`), and `block_dim` says
    which dimension indexes physical blocks (for copies between tiers)."""

    name: str = ""
    # the KV tensor's dimensions, outermost first: "kv" (K, V), "heads" (KV heads), "blocks",
    # "slots" (a block's tokens), "dim" (head_dim); block_dim and slot_dim are read off it
    kv_layout: tuple[str, ...] = ("blocks", "kv", "slots", "heads", "dim")
    block_dim: int  # where "blocks" stands in kv_layout (set for each backend class)
    slot_dim: int  # the token-within-block dimension (> block_dim)
    supports_cuda_graphs: bool = False  # decode steps can be captured (`graph_step`)
    # reads StepMetadata.window_block_tables for the windowed layers (engine/kv/window.py)
    reads_window_tables: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.block_dim = cls.kv_layout.index("blocks")
        cls.slot_dim = cls.kv_layout.index("slots")

    @classmethod
    def kv_cache_shape(
        cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """The shape of one KV group's tensor in this backend's `kv_layout`."""
        sizes = {"kv": 2, "heads": kv_heads, "blocks": num_blocks, "slots": block_size}
        return tuple(head_dim if d == "dim" else sizes[d] for d in cls.kv_layout)

    @classmethod
    @abstractmethod
    def check(
        cls, needs: ModelNeeds, facts: DeviceFacts, dtype: torch.dtype, block_size: int
    ) -> Verdict:
        """Per requirement (matrix.REQUIREMENTS), why this backend cannot serve it here."""

    @classmethod
    def is_fast_on(cls, facts: DeviceFacts) -> bool:
        """False where this backend is a slow general path (a loud warning, or refused under
        --require-fast-kernels)."""
        return True

    @classmethod
    def allocate_workspace(cls, device: torch.device) -> torch.Tensor | None:
        """Device scratch the backend needs for its whole life, allocated by the builder before
        it sizes the KV pool from the memory left (None: none)."""
        return None

    def __init__(
        self,
        spec: ModelSpec,
        kv_caches: list[torch.Tensor],
        block_size: int,
        workspace: torch.Tensor | None = None,
    ) -> None:
        self.spec = spec
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.layer_group = [layer.kv_group for layer in spec.layers]
        self.layer_window = [spec.layer_window(i) for i in range(spec.num_layers)]
        self.windows = sorted(set(self.layer_window), key=lambda w: w or 0)  # distinct ones

    @abstractmethod
    def plan(self, meta: StepMetadata) -> AttentionStep: ...

    def graph_step(self, batch_size: int, max_pages: int) -> Any:
        """A decode step over fixed buffers for CUDA graph capture (`supports_cuda_graphs`):
        `update(meta)` before each replay, then `forward` as any step."""
        raise NotImplementedError(f"{self.name} does not capture CUDA graphs")
