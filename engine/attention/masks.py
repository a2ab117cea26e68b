"""The masks and padded tables the PyTorch attention paths build once per step (the C++ ops take
positions instead): a decode query's keys, a prefill chunk's causal (and windowed) keys."""

from __future__ import annotations

import numpy as np
import torch


def decode_mask(seq_lens: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Additive float32 mask [1, seqs, 1, num_keys] of one decode query per sequence: its
    `seq_lens[i]` keys, or the last `window` of them."""
    key_pos = torch.arange(num_keys)
    keep = key_pos[None, :] < seq_lens[:, None]
    if window is not None:
        keep &= key_pos[None, :] > (seq_lens[:, None] - 1 - window)
    return torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))[None, :, None, :]


def prefill_mask(
    context: int,
    seq_len: int,
    window: int | None,
    image_spans: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor | None:
    """[seq_len - context, seq_len] bool, True = attend: a chunk after `context` earlier tokens
    (causal, within the window); None where plain causal attention over the chunk is it. The
    tokens of each image span [start, end) also see the span's later tokens, as transformers'
    Gemma 3 mask does: the window then still applies (AND(window, OR(causal, image)))."""
    if context == 0 and window is None and not image_spans:
        return None
    q_pos = torch.arange(context, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    m = k_pos <= q_pos
    for start, end in image_spans:
        m |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if window is not None:
        m &= k_pos > q_pos - window  # window tokens, itself included (as HF)
    return m


def padded_tables(tables: list[list[int]], dtype: type) -> np.ndarray:
    """Ragged block tables as one [seqs, longest] array, padded with block 0."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=dtype)
    for row, t in enumerate(tables):
        out[row, : len(t)] = t
    return out
