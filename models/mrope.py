"""M-RoPE (Qwen2.5-VL, Qwen3-VL): rotary positions with three axes (time, height, width).
A text token has the same position on every axis, one past the previous token's largest; an
image's soft tokens have their (t, h, w) coordinates in the merged patch grid, each offset by
the position where the image begins, and the text after it continues from the image's largest
coordinate + 1 (transformers' `get_rope_index`). The rotary frequencies are split among the
axes: contiguous sections (Qwen2.5-VL's `mrope_section`) or interleaved (Qwen3-VL).

A prompt's positions are computed once, at admission; a token past the prompt (an output, a
draft) at index i has position i + delta on every axis, delta = the prompt's largest
position + 1 - its length, as vLLM's rope delta does."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def mrope_positions(
    prompt_len: int, images: Sequence[tuple[int, int, tuple[int, int, int]]], spatial_merge: int
) -> tuple[np.ndarray, int]:
    """[3, prompt_len] int64 positions of a prompt whose images are (offset, soft tokens, patch
    grid (t, h, w)) in order, and the delta of the tokens after the prompt."""
    out = np.empty((3, prompt_len), dtype=np.int64)
    at = cursor = 0  # the next token's index, and the next text position
    for offset, num_tokens, (t, h, w) in images:
        out[:, at:offset] = np.arange(cursor, cursor + offset - at)
        cursor += offset - at
        llm_h, llm_w = h // spatial_merge, w // spatial_merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(llm_h), np.arange(llm_w), indexing="ij")
        grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cursor
        assert grid.shape[1] == num_tokens, "an image's soft tokens are its merged patch grid"
        out[:, offset : offset + num_tokens] = grid
        cursor += max(llm_h, llm_w)
        at = offset + num_tokens
    out[:, at:] = np.arange(cursor, cursor + prompt_len - at)
    delta = int(out.max()) + 1 - prompt_len if prompt_len else 0
    return out, delta


def mrope_axes(section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """The axis (0: t, 1: h, 2: w) each rotary frequency reads its position from. Sections:
    the first section[0] frequencies t's, the next section[1] h's, the rest w's; interleaved
    (Qwen3-VL): frequency j is h's where j % 3 == 1 and j < 3 * section[1], w's where
    j % 3 == 2 and j < 3 * section[2], else t's."""
    half = sum(section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    j = torch.arange(half)
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        axes[(j % 3 == axis) & (j < 3 * section[axis])] = axis
    return axes


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin [tokens, 1, head_dim // 2] of positions [3, tokens], each frequency at
    its axis's position (the layout of `models.layers.rope_cos_sin`)."""
    chosen = positions.to(torch.float32)[axes.to(positions.device)]  # [half, tokens]
    freqs = (chosen.t() * inv_freq[None, :]).contiguous()
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin
