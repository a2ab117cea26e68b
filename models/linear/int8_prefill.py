"""int8 rows (`Int8Weight`), W8A8 for the dense path of GGUF weights (prefill: many rows): the
weight dequantized from its blocks and rounded again per output channel to int8, each activation
row rounded to int8 by its own range, int32 sums from `torch._int_mm` (oneDNN: VNNI where the CPU
has it), scaled back in one pass (kernels/int8_rows.cpp; its build and fallback: kernels/build.py).

Whether it serves is measured at startup (engine/weights/quantization.py: faster than the packed
float GEMM at the rows it takes, and the model on it agrees with float prefill on held-out text).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels.ops import INT8_ROWS
from models.linear.w8a8 import smoothing


def load() -> Any:
    """The compiled ops (`.quantize_rows`, `.scale_rows`), or None where they cannot be built
    or `torch._int_mm` is not exact here."""
    return INT8_ROWS.load() if int_mm_exact() else None


@functools.cache
def int_mm_exact() -> bool:
    """Whether `torch._int_mm` gives exact int32 sums here, measured on full-range codes: under
    an AVX2-only oneDNN (no VNNI) its int8 pairs go through saturating int16 sums (seen here:
    outputs at cosine -0.3 of the true product)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (256, 32), dtype=torch.int8, generator=g)
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


# SmoothQuant's migration strength: a factor per input channel of max|x|^a / max|w|^(1 - a).
SMOOTHING_ALPHA = 0.65


def smoothing_for(input_range: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The factor activations are multiplied by before rounding (float32 [in]), from max |x| per
    input channel over calibration text: SmoothQuant's 1 / s, which moves a channel's outliers
    into the weight's column (multiplied by s) where per-channel rounding absorbs them."""
    return (1 / smoothing(input_range.float(), dense, SMOOTHING_ALPHA)).contiguous()


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """The int8 rows format: a weight [out, in] as int8 [in, out] (the GEMM's right operand),
    float32 scales [out], the layer's bias (float32) and, where smoothed, the factor
    [in] float32 each activation column is multiplied by before rounding (the weight's columns
    were divided by it: the product is the same function)."""

    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None
    smoothing: torch.Tensor | None = None

    @staticmethod
    def from_dense(
        dense: torch.Tensor,
        bias: torch.Tensor | None = None,
        smoothing: torch.Tensor | None = None,
    ) -> Int8Weight:
        w = dense.float() if smoothing is None else dense.float() / smoothing[None, :]
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8Weight(q.t().contiguous(), scales.contiguous(), bias, smoothing)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def rows(self, index: slice | torch.Tensor, part: object = None) -> Int8Weight:
        """Output rows `index` (each row is rounded by its own scale: the same codes as the
        rows quantized alone)."""
        bias = None if self.bias is None else self.bias[index]
        weight, scales = self.weight[:, index].contiguous(), self.scales[index].contiguous()
        return Int8Weight(weight, scales, bias, self.smoothing)

    def pack(self) -> int:
        return 0

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] float32 or bf16 -> [rows, out] in x's dtype."""
        ops = load()
        xq, xs = ops.quantize_rows(x.contiguous(), self.smoothing)
        acc = torch._int_mm(xq, self.weight)
        return ops.scale_rows(acc, xs, self.scales, None if bias is None else bias.float(), x.dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scales.numel()
