"""Reference paged attention in plain PyTorch; runs on CPU and GPU.

Decode rows (one query token) are attended together: their pages are gathered into a padded
[seqs, pages * block_size] key range and reduced with two batched matmuls that handle GQA without
repeating K/V. Prefill chunks are attended one sequence at a time with SDPA; a chunk with no
earlier context attends its own fresh K/V directly, skipping the page gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata
from models.spec import ModelSpec


@dataclass(slots=True)
class _Prefill:
    rows: slice
    context_len: int
    seq_len: int
    block_ids: torch.Tensor | None  # pages to gather when context_len > 0
    mask: torch.Tensor | None  # [q, seq_len] bool, True = attend; None = plain causal


class TorchAttentionStep(AttentionStep):
    def __init__(self, backend: TorchBackend, meta: StepMetadata) -> None:
        self.backend = backend
        device = backend.kv_caches[0].device
        bs = backend.block_size
        slots = meta.slot_mapping
        self.slot_block = slots // bs
        self.slot_offset = slots % bs
        window = backend.spec.sliding_window

        decode_seqs = [i for i, q in enumerate(meta.query_lens) if q == 1]
        self.num_tokens = sum(meta.query_lens)
        self.all_decode = len(decode_seqs) == meta.num_seqs
        self.decode_rows = torch.tensor([meta.query_start[i] for i in decode_seqs], device=device)
        self.decode_tables: torch.Tensor | None = None
        self.decode_mask: torch.Tensor | None = None
        if decode_seqs:
            max_pages = max(len(meta.block_tables[i]) for i in decode_seqs)
            table = torch.zeros(len(decode_seqs), max_pages, dtype=torch.long)
            for row, i in enumerate(decode_seqs):
                ids = meta.block_tables[i]
                table[row, : len(ids)] = torch.tensor(ids)
            seq_lens = torch.tensor([meta.seq_lens[i] for i in decode_seqs])
            key_pos = torch.arange(max_pages * bs)
            mask = key_pos[None, :] < seq_lens[:, None]
            if window is not None:
                mask &= key_pos[None, :] > (seq_lens[:, None] - 1 - window)
            self.decode_tables = table.to(device)
            # additive mask [seqs, 1, 1, keys]: broadcast over kv heads and grouped query heads
            self.decode_mask = torch.zeros(mask.shape, device=device).masked_fill_(
                ~mask.to(device), float("-inf")
            )[:, None, None, :]

        self.prefills: list[_Prefill] = []
        for i, q_len in enumerate(meta.query_lens):
            if q_len == 1:
                continue
            start, ctx, seq = meta.query_start[i], meta.context_lens[i], meta.seq_lens[i]
            mask = None
            block_ids = None
            if ctx > 0 or window is not None:
                q_pos = torch.arange(ctx, seq)[:, None]
                k_pos = torch.arange(seq)[None, :]
                m = k_pos <= q_pos
                if window is not None:
                    m &= k_pos > q_pos - 1 - window
                mask = m.to(device)
            if ctx > 0:
                block_ids = torch.tensor(meta.block_tables[i][: -(-seq // bs)], device=device)
            self.prefills.append(_Prefill(slice(start, start + q_len), ctx, seq, block_ids, mask))

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        backend = self.backend
        cache = backend.kv_caches[backend.layer_group[layer_idx]]
        cache[self.slot_block, 0, self.slot_offset] = k
        cache[self.slot_block, 1, self.slot_offset] = v
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = q.new_empty(q.shape)
        if self.decode_tables is not None:
            qd = q if self.all_decode else q.index_select(0, self.decode_rows)
            od = self._decode(qd, cache, scale)
            if self.all_decode:
                return od
            out.index_copy_(0, self.decode_rows, od)
        for p in self.prefills:
            out[p.rows] = self._prefill(p, q[p.rows], k[p.rows], v[p.rows], cache, scale)
        return out

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
        assert self.decode_tables is not None and self.decode_mask is not None
        n, heads, dim = q.shape
        pages = cache[self.decode_tables]  # [n, pages, 2, bs, kv_heads, dim]
        kv_heads = pages.shape[-2]
        keys = pages[:, :, 0].reshape(n, -1, kv_heads, dim).permute(0, 2, 3, 1)  # [n, h, d, L]
        values = pages[:, :, 1].reshape(n, -1, kv_heads, dim).transpose(1, 2)  # [n, h, L, d]
        qg = q.view(n, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(qg, keys) * scale + self.decode_mask  # [n, h, g, L]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, values).reshape(n, heads, dim)

    def _prefill(
        self,
        p: _Prefill,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if p.block_ids is not None:
            pages = cache[p.block_ids]  # [pages, 2, bs, kv_heads, dim]
            k = pages[:, 0].reshape(-1, *k.shape[1:])[: p.seq_len]
            v = pages[:, 1].reshape(-1, *v.shape[1:])[: p.seq_len]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1)


class TorchBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def unsupported_reasons(
        cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype, block_size: int
    ) -> list[str]:
        reasons = []
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            reasons.append(f"{dtype} on this CPU is far slower than float32 (no native support)")
        for lay in spec.layers:
            if lay.num_heads % lay.num_kv_heads:
                reasons.append(f"{lay.num_heads} query heads not a multiple of {lay.num_kv_heads}")
                break
        return reasons

    def plan(self, meta: StepMetadata) -> TorchAttentionStep:
        return TorchAttentionStep(self, meta)
