"""The reference attention backend (`attention_backend = "reference"`): each sequence's pages
gathered into a contiguous K/V and handed to `torch.nn.functional.scaled_dot_product_attention`
under an explicit causal (and windowed) mask. Plain PyTorch and nothing else, so it runs on CPU
and GPU alike and is the one to read, to check a fast backend against, or to serve a model no
other backend takes; it is never chosen by `auto` ahead of those (last in priority, and a slow
general path: a loud warning when it serves).

KV layout: one tensor per KV group, [2, kv_heads, num_blocks, block_size, head_dim] (the CPU
backend's, so an int8 cache is the same rows with their scales, engine/attention/kv_quant.py).
Every step, decode or prefill, is one gather + SDPA per sequence per layer; per-layer windows
(Gemma 3's mixed ones), GQA, per-layer head counts and KV shared across layers need nothing
more. Logit soft-capping and tree masks are refused: SDPA has no soft-cap, and verification
here is linear chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import kv_quant
from engine.attention.base import HEADS_OUTERMOST, AttentionBackend, AttentionStep, StepMetadata
from engine.attention.matrix import DeviceFacts, ModelNeeds, Verdict, model_refusals, slow_cpu_dtype


def causal_mask(
    context: int, seq_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[seq_len - context, seq_len] bool, True = attend: each query at position context + i
    sees the keys up to itself, and with a window only the last `window` of them (itself
    included, as transformers counts it)."""
    q_pos = torch.arange(context, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    return keep


class ReferenceStep(AttentionStep):
    """One step's sequences: their query rows, context and pages; masks built at first use
    per (sequence, window) and kept for the step's other layers."""

    def __init__(self, backend: ReferenceBackend, meta: StepMetadata) -> None:
        self.backend = backend
        device = backend.kv_caches[0].device
        bs = backend.block_size
        slots = meta.slot_mapping.to(device)
        self.slot_block, self.slot_offset = slots // bs, slots % bs
        self.seqs: list[tuple[slice, int, int, torch.Tensor]] = []  # rows, context, len, pages
        for i in range(meta.num_seqs):
            start, seq = meta.query_start[i], meta.seq_lens[i]
            pages = torch.tensor(meta.block_tables[i][: -(-seq // bs)], device=device)
            self.seqs.append(
                (slice(start, start + meta.query_lens[i]), meta.context_lens[i], seq, pages)
            )
        self.masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        backend = self.backend
        cache = backend.kv_caches[backend.layer_group[layer_idx]]
        cache = kv_quant.write_kv(cache, self.slot_block, self.slot_offset, k, v)
        window = backend.layer_window[layer_idx]
        kv_heads, width = cache.shape[1], cache.shape[-1]
        out = torch.empty_like(q)
        for i, (rows, context, seq_len, pages) in enumerate(self.seqs):
            keys = cache[0].index_select(1, pages).reshape(kv_heads, -1, width)[:, :seq_len]
            values = cache[1].index_select(1, pages).reshape(kv_heads, -1, width)[:, :seq_len]
            mask = self.masks.get((i, window))
            if mask is None:
                mask = causal_mask(context, seq_len, window, q.device)
                self.masks[(i, window)] = mask
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),  # [heads, rows, head_dim]
                kv_quant.read(keys, q.dtype),
                kv_quant.read(values, q.dtype),
                attn_mask=mask,
                enable_gqa=True,
            )
            out[rows] = o.transpose(0, 1)
        return out


class ReferenceBackend(AttentionBackend):
    name = "reference"
    kv_layout = HEADS_OUTERMOST

    @classmethod
    def check(
        cls, needs: ModelNeeds, facts: DeviceFacts, dtype: torch.dtype, block_size: int
    ) -> Verdict:
        """Any device, head size and block size; a slow CPU dtype as the CPU backend refuses it
        (waivable), and what SDPA cannot express."""
        return slow_cpu_dtype(facts, dtype) | model_refusals(needs, soft_cap=False, int8_kv=True)

    @classmethod
    def is_fast_on(cls, facts: DeviceFacts) -> bool:
        return False  # a gather and an unfused masked SDPA per sequence and layer

    def plan(self, meta: StepMetadata) -> ReferenceStep:
        return ReferenceStep(self, meta)
