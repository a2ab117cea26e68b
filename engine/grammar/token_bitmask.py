"""Applying grammar token bitmasks to logits rows: a C++ op on CPU (kernels/token_bitmask.cpp,
compiled at first use, see kernels/build.py), PyTorch elsewhere and as the fallback."""

from __future__ import annotations

import torch

from kernels.ops import TOKEN_BITMASK

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    vocab = logits.shape[1]
    shifts = _SHIFTS.to(bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (in place; float32 logits)."""
    index = torch.tensor(rows, dtype=torch.long)
    cpu_f32 = logits.device.type == "cpu" and logits.dtype == torch.float32
    ops = TOKEN_BITMASK.load() if cpu_f32 and logits.is_contiguous() else None
    if ops is not None:
        ops.apply_(logits, bitmask.contiguous(), index)
    else:
        apply_bitmask_torch(logits, bitmask.to(logits.device), index.to(logits.device))
