"""Decode attention that reads each sequence's KV straight out of the pool, without gathering it.

Why: a decode step is bound by reading KV. Gathering pages into a padded [seqs, keys] tensor and
then multiplying reads the KV three times (gather read, gather write, matmul read). Here the
matmul operand is a *view* of the pool: for the contiguous range of block ids [lo, hi) that the
batch uses, every block is multiplied by the query of the sequence that owns it (one batched
matmul per KV head), so the KV is read once. Only small tensors move: per-block queries, per-block
scores and probabilities (1/bs... of the KV size), which are regrouped per sequence for the
softmax.

Blocks shared by several sequences of the batch (prefix-cache hits) have no single owner; those
(block, sequence) pairs take the gather path. Blocks inside [lo, hi) that the batch does not use
are computed and discarded, so the plan is only used when the batch covers at least
`MIN_DENSITY` of its range.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.masks import decode_mask

MIN_DENSITY = 0.5


@dataclass(slots=True)
class RangeDecodePlan:
    lo: int
    hi: int
    num_seqs: int
    max_blocks: int
    owner_of_block: torch.Tensor  # [hi - lo] owning seq, or num_seqs (a zero query) if none
    unique_pairs: torch.Tensor  # pair ids whose block has one owner
    unique_rel: torch.Tensor  # their block - lo
    shared_pairs: torch.Tensor  # pair ids whose block several sequences use
    shared_blocks: torch.Tensor
    shared_seqs: torch.Tensor
    pair_of_slot: torch.Tensor  # [seqs * max_blocks] pair id, or num_pairs (padding, -inf)
    slot_of_pair: torch.Tensor  # [num_pairs] seq * max_blocks + j
    masks: dict[int | None, torch.Tensor]  # per window: [1, seqs, 1, max_blocks * bs] additive

    @staticmethod
    def build(
        tables: list[list[int]],
        seq_lens: list[int],
        block_size: int,
        windows: Iterable[int | None],
        device: torch.device,
    ) -> RangeDecodePlan | None:
        nb = [-(-n // block_size) for n in seq_lens]
        blocks = np.concatenate([np.asarray(t[:k], dtype=np.int64) for t, k in zip(tables, nb)])
        seqs = np.repeat(np.arange(len(tables)), nb)
        js = np.concatenate([np.arange(k) for k in nb])
        owners = np.bincount(blocks)
        shared = owners[blocks] > 1
        unique = ~shared
        if not unique.any():
            return None
        lo, hi = int(blocks[unique].min()), int(blocks[unique].max()) + 1
        if unique.sum() < MIN_DENSITY * (hi - lo):
            return None
        num_seqs, max_blocks, num_pairs = len(tables), max(nb), len(blocks)
        owner_of_block = np.full(hi - lo, num_seqs, dtype=np.int64)
        owner_of_block[blocks[unique] - lo] = seqs[unique]
        slot_of_pair = seqs * max_blocks + js
        pair_of_slot = np.full(num_seqs * max_blocks, num_pairs, dtype=np.int64)
        pair_of_slot[slot_of_pair] = np.arange(num_pairs)
        lens = torch.tensor(seq_lens)
        masks = {w: decode_mask(lens, max_blocks * block_size, w).to(device) for w in windows}

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        return RangeDecodePlan(
            lo,
            hi,
            num_seqs,
            max_blocks,
            t(owner_of_block),
            t(np.flatnonzero(unique)),
            t(blocks[unique] - lo),
            t(np.flatnonzero(shared)),
            t(blocks[shared]),
            t(seqs[shared]),
            t(pair_of_slot),
            t(slot_of_pair),
            masks,
        )

    def attend(
        self, q: torch.Tensor, cache: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """q: [seqs, heads, dim] in plan order; cache: [2, kv_heads, blocks, bs, dim]; `window`
        one of those the plan was built for."""
        n, heads, dim = q.shape
        kv_heads, bs = cache.shape[1], cache.shape[3]
        group = heads // kv_heads
        num_pairs = self.slot_of_pair.numel()
        keys, values = cache[0][:, self.lo : self.hi], cache[1][:, self.lo : self.hi]
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bf16 cache under float32
        # queries per sequence, plus a zero row for blocks nobody in the batch owns
        qg = torch.zeros(kv_heads, n + 1, group, dim, dtype=q.dtype, device=q.device)
        qg[:, :n] = (q * scale).view(n, kv_heads, group, dim).transpose(0, 1)

        # scores per (block, sequence) pair: [kv_heads, pairs + 1 (padding), group, bs]
        pair_scores = q.new_full((kv_heads, num_pairs + 1, group, bs), float("-inf"))
        q_blocks = qg.index_select(1, self.owner_of_block)  # [h, range, g, d]
        range_scores = torch.stack(
            [torch.bmm(q_blocks[h], keys[h].transpose(1, 2)) for h in range(kv_heads)]
        )
        pair_scores[:, self.unique_pairs] = range_scores.index_select(1, self.unique_rel)
        if self.shared_pairs.numel():
            k_shared = cache[0].index_select(1, self.shared_blocks).to(q.dtype)  # [h, s, bs, d]
            q_shared = qg.index_select(1, self.shared_seqs)  # [h, s, g, d]
            pair_scores[:, self.shared_pairs] = torch.matmul(q_shared, k_shared.transpose(-1, -2))

        # softmax per sequence over its blocks laid end to end
        mb = self.max_blocks
        seq_scores = (
            pair_scores.index_select(1, self.pair_of_slot)
            .view(kv_heads, n, mb, group, bs)
            .transpose(2, 3)
            .reshape(kv_heads, n, group, mb * bs)
        )
        # softmax in float32 (the mask is float32), probabilities back in the KV dtype: bf16/fp16
        # scores must not promote the probabilities that multiply bf16/fp16 values
        probs = torch.softmax(seq_scores.float() + self.masks[window], dim=-1).to(q.dtype)
        pair_probs = (
            probs.view(kv_heads, n, group, mb, bs)
            .transpose(2, 3)
            .reshape(kv_heads, n * mb, group, bs)
            .index_select(1, self.slot_of_pair)
        )  # [h, pairs, g, bs]

        out = torch.zeros(kv_heads, n + 1, group, dim, dtype=q.dtype, device=q.device)
        range_probs = q.new_zeros((kv_heads, self.hi - self.lo, group, bs))
        range_probs[:, self.unique_rel] = pair_probs.index_select(1, self.unique_pairs)
        range_out = torch.stack(
            [torch.bmm(range_probs[h], values[h]) for h in range(kv_heads)]
        )  # [h, range, g, d]
        out.index_add_(1, self.owner_of_block, range_out)
        if self.shared_pairs.numel():
            v_shared = cache[1].index_select(1, self.shared_blocks)
            p_shared = pair_probs.index_select(1, self.shared_pairs)
            out.index_add_(1, self.shared_seqs, torch.matmul(p_shared, v_shared))
        return out[:, :n].transpose(0, 1).reshape(n, heads, dim)
