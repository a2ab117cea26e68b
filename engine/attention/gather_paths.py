"""The CPU backend's PyTorch gather paths (engine/attention/torch_backend.py), for what its C++
ops do not take: decode rows in buckets of similar length (padding bounded by the bucket),
attended with two batched matmuls that handle GQA without repeating K/V; prefill chunks with
SDPA, a chunk with no earlier context attending its own fresh K/V directly and one with context
gathering its pages under a mask."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import kv_quant
from engine.attention.base import StepMetadata, sdpa_rows
from engine.attention.masks import decode_mask, padded_tables, prefill_mask

DECODE_BUCKET = 16  # sequences per decode bucket (sorted by length)


@dataclass(slots=True)
class DecodeBucket:
    rows: torch.Tensor  # query rows of these sequences in the flat batch
    pages: torch.Tensor  # [seqs * max_pages] block ids, padded with block 0
    num_seqs: int
    masks: dict[int | None, torch.Tensor]  # per window: [1, seqs, 1, max_pages * bs] additive


@dataclass(slots=True)
class PrefillChunk:
    rows: slice
    seq_len: int
    pages: torch.Tensor  # the sequence's blocks, int32
    context: int  # tokens before the chunk
    # per window, [q, seq_len] bool, True = attend; None = plain causal. Built when SDPA
    # first serves the chunk in a layer of that window, then kept for the step's other layers
    masks: dict[int | None, torch.Tensor | None]
    image_spans: tuple[tuple[int, int], ...] = ()  # positions attending both ways


def decode_buckets(
    meta: StepMetadata,
    decode: list[int],
    block_size: int,
    windows: Iterable[int | None],
    device: torch.device,
) -> list[DecodeBucket]:
    """The decode rows `decode` (indices into the step's sequences) in buckets of similar
    length, each with its padded page table and one additive mask per window."""
    bs, buckets = block_size, []
    for b in range(0, len(decode), DECODE_BUCKET):
        seqs = decode[b : b + DECODE_BUCKET]
        table = torch.from_numpy(padded_tables([meta.block_tables[i] for i in seqs], np.int64))
        keys = table.shape[1] * bs
        seq_lens = torch.tensor([meta.seq_lens[i] for i in seqs])
        buckets.append(
            DecodeBucket(
                torch.tensor([meta.query_start[i] for i in seqs], device=device),
                table.flatten().to(device),
                len(seqs),
                {w: decode_mask(seq_lens, keys, w).to(device) for w in windows},
            )
        )
    return buckets


def gather_decode(
    bucket: DecodeBucket,
    q: torch.Tensor,
    cache: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    n, heads, dim = q.shape
    kv_heads, width = cache.shape[1], cache.shape[-1]
    keys = cache[0].index_select(1, bucket.pages).view(kv_heads, n, -1, width)  # [h, n, L, w]
    values = cache[1].index_select(1, bucket.pages).view(kv_heads, n, -1, width)
    # a bf16 cache under float32, an int8 one under either
    keys, values = kv_quant.read(keys, q.dtype), kv_quant.read(values, q.dtype)
    qg = q.view(n, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [h, n, g, d]
    scores = torch.matmul(qg * scale, keys.transpose(-1, -2))  # [h, n, g, L]
    # softmax in float32 against the float32 mask, probabilities back in the KV dtype (a
    # bf16/fp16 cache must not meet float32 probabilities in the matmul below)
    probs = torch.softmax(scores.float() + bucket.masks[window], dim=-1).to(values.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(n, heads, dim)


def gather_prefill(
    p: PrefillChunk,
    q: torch.Tensor,
    fresh: tuple[torch.Tensor, torch.Tensor] | None,
    cache: torch.Tensor,
    scale: float,
    window: int | None,
    two_way: bool = True,
) -> torch.Tensor:
    """`two_way` False: the chunk's image spans stay causal in this layer (its masks are kept
    per window, and a model's layers of one window agree on it)."""
    if window not in p.masks:
        spans = p.image_spans if two_way else ()
        mask = prefill_mask(p.context, p.seq_len, window, spans)
        p.masks[window] = mask.to(q.device) if mask is not None else None
    mask = p.masks[window]
    if p.context > 0 or fresh is None:
        kv_heads, width = cache.shape[1], cache.shape[-1]
        keys = cache[0].index_select(1, p.pages).view(kv_heads, -1, width)[:, : p.seq_len]
        values = cache[1].index_select(1, p.pages).view(kv_heads, -1, width)[:, : p.seq_len]
        keys, values = kv_quant.read(keys, q.dtype), kv_quant.read(values, q.dtype)
    else:
        keys, values = fresh[0].transpose(0, 1), fresh[1].transpose(0, 1)
    return sdpa_rows(q, keys, values, mask, scale)
