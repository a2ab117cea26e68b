"""The int8 KV cache's rows in PyTorch, for the paths that are not the C++ ops (the format and
why it is per row: kernels/kv_int8.h). A row of one KV head's `head_dim` values is stored as that
many int8 values followed by one float32 scale per GROUP values, all in the int8 cache tensor, so
a block stays one slice along the block dimension for every tier that copies blocks."""

from __future__ import annotations

import torch

GROUP = 32  # values per scale (llama.cpp's q8_0 grouping)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the cache's dtype one row of `head_dim` values takes."""
    return head_dim + 4 * (head_dim // GROUP) if dtype == torch.int8 else head_dim


def bytes_per_value(dtype: torch.dtype) -> float:
    """Bytes the cache spends on one K or V value (int8: the value and its share of a scale)."""
    return 1 + 4 / GROUP if dtype == torch.int8 else dtype.itemsize


def refusal(head_dims: tuple[int, ...]) -> str | None:
    """Why an int8 cache cannot hold heads of these sizes, or None."""
    odd = [d for d in head_dims if d % GROUP]
    return f"head_dim {odd[0]} is not a multiple of {GROUP} (a scale per {GROUP})" if odd else None


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float rows as int8 rows with their scales (as the C++ ops write them)."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    values = torch.round(groups * inv).to(torch.int8).flatten(-2)
    return torch.cat([values, scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows with their scales [..., row_width] as [..., head_dim] values of `dtype`."""
    head_dim = rows.shape[-1] * GROUP // (GROUP + 4)
    scales = rows[..., head_dim:].contiguous().view(torch.float32)
    values = rows[..., :head_dim].float().unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def read(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows in the arithmetic's dtype, whatever the cache stores."""
    return dequantize(cache_rows, dtype) if cache_rows.dtype == torch.int8 else cache_rows.to(dtype)


def write(cache_rows: torch.Tensor, index: tuple, x: torch.Tensor) -> None:
    """Store x's rows at `index` of the cache (`cache_rows[index] = x`, rounded to its dtype)."""
    cache_rows[index] = quantize(x) if cache_rows.dtype == torch.int8 else x.to(cache_rows.dtype)


def write_kv(
    cache: torch.Tensor,
    slot_block: torch.Tensor,
    slot_offset: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
) -> torch.Tensor:
    """A layer's KV group in the heads-first layout [2, kv_heads, blocks, block_size, width]
    (the CPU and reference backends') with the step's new k and v [tokens, kv_heads, head_dim]
    written into their slots, rounded to the cache's dtype; k and v None for a layer reading a
    group another layer wrote. Returns the cache."""
    if k is not None and v is not None:
        slots = (slice(None), slot_block, slot_offset)
        write(cache[0], slots, k.transpose(0, 1))
        write(cache[1], slots, v.transpose(0, 1))
    return cache
