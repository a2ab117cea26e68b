"""xformers paged attention (CUDA; the `gpu` extra) for rows FlashInfer does not cover: head
dims 16, 32 and 512 (FlashInfer compiles 64/128/256), pages of 128 tokens (FlashInfer: 16-64).

Decode rows go to xformers' Triton split-K operator (`triton_splitk.FwOp`), the operator that
accepts paged masks, through `PagedBlockDiagonalCausalWithOffsetPaddedKeysMask` (one query per
sequence, bottom-right causal over its `kv_seqlen` keys, pages from `block_tables`). It is pure
Triton, so it runs with any torch that has Triton (the wheel's C++/CUDA extension, built for one
torch and CUDA, is not needed). Its limits are the verdicts in `check()`: sm80+, float16 or
bfloat16, head_dim in {16, 32, 64, 128, 256, 512}, page size a multiple of its BLOCK_N (64),
uniform query lengths. Prefill chunks (ragged query lengths, which the operator refuses for
causal masks) gather their pages and use PyTorch's SDPA (flash kernels on the GPU).

KV layout: one tensor per KV group, [2, num_blocks, block_size, kv_heads, head_dim]: K (and V)
viewed as [1, num_blocks * block_size, kv_heads, head_dim] is exactly the operator's paged K/V;
GQA goes through the 5-D BMGHK form (queries [1, n, kv_heads, group, d], K/V expanded over the
group without copies).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from engine.attention.base import (
    AttentionBackend,
    AttentionStep,
    StepMetadata,
    paged_layer_cache,
    sdpa_rows,
)
from engine.attention.matrix import DeviceFacts, ModelNeeds, Verdict, gpu_verdict, model_refusals

HEAD_DIMS = (16, 32, 64, 128, 256, 512)
BLOCK_N = 64  # triton_splitk.FwOp.BLOCK_N: a page must hold whole key blocks
VERSION = "0.0.35"


def paged_decode_bias(
    seq_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> Any:
    """The paged causal mask for one query per sequence: block tables padded with block 0 to
    the longest, int32 on the device."""
    from xformers.ops.fmha.attn_bias import PagedBlockDiagonalCausalWithOffsetPaddedKeysMask

    pages = [-(-n // block_size) for n in seq_lens]
    table = np.zeros((len(seq_lens), max(pages)), dtype=np.int32)
    for row, (t, p) in enumerate(zip(block_tables, pages)):
        table[row, :p] = t[:p]
    return PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=[1] * len(seq_lens),
        kv_seqlen=seq_lens,
        block_tables=torch.from_numpy(table).to(device),
        page_size=block_size,
        device=device,
    )


class XFormersStep(AttentionStep):
    def __init__(self, backend: XFormersBackend, meta: StepMetadata) -> None:
        self.backend = backend
        device = backend.kv_caches[0].device
        bs = backend.block_size
        slots = meta.slot_mapping
        self.slot_block, self.slot_offset = slots // bs, slots % bs
        decode = [i for i, q in enumerate(meta.query_lens) if q == 1]
        self.all_decode = len(decode) == meta.num_seqs
        self.decode_rows = (
            None
            if self.all_decode or not decode
            else torch.tensor([meta.query_start[i] for i in decode], device=device)
        )
        self.bias = (
            paged_decode_bias(
                [meta.seq_lens[i] for i in decode],
                [meta.block_tables[i] for i in decode],
                bs,
                device,
            )
            if decode
            else None
        )
        # prefill chunks: (rows, seq_len, pages on the device, first query position)
        self.prefills: list[tuple[slice, int, torch.Tensor, int]] = []
        for i, q_len in enumerate(meta.query_lens):
            if q_len == 1:
                continue
            start, seq = meta.query_start[i], meta.seq_lens[i]
            pages = torch.tensor(meta.block_tables[i][: -(-seq // bs)], device=device)
            self.prefills.append((slice(start, start + q_len), seq, pages, meta.context_lens[i]))

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        cache = paged_layer_cache(
            self.backend, layer_idx, k, v, self.slot_block, self.slot_offset, 0
        )
        scale = 1.0 / math.sqrt(q.shape[-1])
        if self.bias is not None:
            qd = q if self.all_decode else q.index_select(0, self.decode_rows)
            od = self._decode(qd, cache, scale)
            if self.all_decode:
                return od
            out = q.new_empty(q.shape)
            out.index_copy_(0, self.decode_rows, od)
        else:
            out = q.new_empty(q.shape)
        for rows, seq_len, pages, ctx in self.prefills:
            out[rows] = self._prefill(q[rows], cache, pages, seq_len, ctx, scale)
        return out

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
        from xformers.ops import fmha

        n, heads, dim = q.shape
        _, blocks, bs, kv_heads, _ = cache.shape
        group = heads // kv_heads
        k = cache[0].view(1, blocks * bs, kv_heads, 1, dim).expand(-1, -1, -1, group, -1)
        v = cache[1].view(1, blocks * bs, kv_heads, 1, dim).expand(-1, -1, -1, group, -1)
        out = fmha.memory_efficient_attention_forward(
            q.reshape(1, n, kv_heads, group, dim),
            k,
            v,
            attn_bias=self.bias,
            scale=scale,
            op=fmha.triton_splitk.FwOp,
        )
        return out.reshape(n, heads, dim)

    def _prefill(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        pages: torch.Tensor,
        seq_len: int,
        ctx: int,
        scale: float,
    ) -> torch.Tensor:
        kv_heads, dim = cache.shape[3], cache.shape[4]
        keys = cache[0].index_select(0, pages).reshape(-1, kv_heads, dim)[:seq_len]
        values = cache[1].index_select(0, pages).reshape(-1, kv_heads, dim)[:seq_len]
        mask = None
        if ctx > 0:  # bottom-right causal: query j sits at position ctx + j
            q_pos = torch.arange(ctx, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        return sdpa_rows(q, keys.transpose(0, 1), values.transpose(0, 1), mask, scale)


class XFormersBackend(AttentionBackend):
    name = "xformers"
    kv_layout = ("kv", "blocks", "slots", "heads", "dim")

    @classmethod
    def check(
        cls, needs: ModelNeeds, facts: DeviceFacts, dtype: torch.dtype, block_size: int
    ) -> Verdict:
        verdict = gpu_verdict(
            facts,
            "xformers",
            (8, 0),
            dtype,
            capability_why=" (Triton split-K paged decode)",
            dtype_why="the paged operator takes float16/bfloat16",
        )
        if block_size % BLOCK_N:
            verdict["block size"] = (
                f"page size {block_size} is not a multiple of the Triton split-K BLOCK_N "
                f"({BLOCK_N}); use --block-size 64 or 128"
            )
        return verdict | model_refusals(
            needs, head_dims=HEAD_DIMS, sliding_window=False, soft_cap=False
        )

    def plan(self, meta: StepMetadata) -> XFormersStep:
        return XFormersStep(self, meta)
