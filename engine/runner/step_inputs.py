"""A step's flat inputs from (block table, first position, number of tokens) per sequence:
positions, slots and attention metadata, with per-sequence numpy work and one host-to-device
copy. The target's runner and the draft head's catch-up both build their steps here."""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.base import StepMetadata


def step_metadata(
    seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, StepMetadata]:
    """Positions and attention metadata for a flat batch of (block table, first position, number
    of tokens) per sequence: per-sequence numpy work, nothing per token in Python."""
    _, positions, meta, _ = step_inputs(seqs, block_size, device)
    return positions, meta


def step_inputs(
    seqs: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
    token_ids: list[int] | None = None,
    rows: list[int] | None = None,
    window_tables: list[list[int]] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, StepMetadata, torch.Tensor | None]:
    """`step_metadata` plus the token ids and the logits rows, all uploaded in one host-to-device
    copy (positions, slots, ids and rows are int64 views of one tensor): one transfer per step
    instead of one per tensor. Returns (input ids or None, positions, metadata, rows or None).
    `window_tables`: each sequence's table into the sliding-window layers' own pool."""
    pos_chunks, slot_chunks, window_chunks = [], [], []
    query_start, query_lens, context_lens, seq_lens, tables = [], [], [], [], []
    row = 0
    for table, start, n in seqs:
        positions = np.arange(start, start + n)
        table_np = np.asarray(table, dtype=np.int64)
        slot_chunks.append(table_np[positions // block_size] * block_size + positions % block_size)
        if window_tables is not None:
            window = np.asarray(window_tables[len(tables)], dtype=np.int64)
            blocks, offsets = positions // block_size, positions % block_size
            window_chunks.append(window[blocks] * block_size + offsets)
        pos_chunks.append(positions)
        query_start.append(row)
        query_lens.append(n)
        context_lens.append(start)
        seq_lens.append(start + n)
        tables.append(table)
        row += n
    parts = [*pos_chunks, *slot_chunks, *window_chunks]
    if token_ids is not None:
        parts.append(np.asarray(token_ids, dtype=np.int64))
    if rows is not None:
        parts.append(np.asarray(rows, dtype=np.int64))
    flat = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)).to(device)
    positions, slots = flat[:row], flat[row : 2 * row]
    at = 3 * row if window_tables is not None else 2 * row
    ids = flat[at : at + row] if token_ids is not None else None
    rows_t = flat[flat.numel() - len(rows) :] if rows is not None else None
    window_slots = flat[2 * row : 3 * row] if window_tables is not None else None
    meta = StepMetadata(
        query_start, query_lens, context_lens, seq_lens, tables, slots, window_tables, window_slots
    )
    return ids, positions, meta, rows_t
