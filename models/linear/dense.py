"""The dense formats: a float weight [out, in] multiplied by torch as it is (`DensePlain`) or from
a oneDNN-packed copy (`OneDNNPacked`), and `DenseWeight`, which of the two takes a step's rows:
the packed copy from `packed_min_rows` rows, as the startup measurement found it faster
(models/linear/measure.py `measure_packed_rows`).

Why the plain path computes `(W @ x.T).T` on CPU: with W stored [out, in] (HF layout) MKL runs
that as a GEMM with a skinny right-hand side, which reads weights at close to memory bandwidth
for 2-16 rows, while `x @ W.T` / `F.linear` at 2-16 rows runs 2-3x slower and a single row goes
down MKL's GEMV path at half the bandwidth. One row is therefore padded to two. Measured over
SmolLM2's 30 layers of weights (424 MB, out of cache) here: 1 row 27.5 ms (x @ W_t, the old
layout) -> 14.8 ms; 5 rows 41 -> 24 ms; 64 rows 119 -> 93 ms; 1024 rows equal
(`docs/spikes/matmul_layouts.py`). On CUDA `F.linear` is one cuBLAS call and is used as is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias) -> [rows, out], the fastest form on CPU."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        # bf16 (unpacked only with --no-cpu-packed-weights): the (W @ x.T).T form is MKL's
        # float32 trick; oneDNN's bf16 F.linear measured as fast at 2-64 rows, faster at one
        return F.linear(x, weight, bias)
    # MKL's fast path wants x row-major (so x.t() is a transposed view) and at least two rows.
    rows = x.shape[0]
    xt = (x.contiguous() if rows > 1 else x.expand(2, -1).contiguous()).t()
    if bias is None:
        out = torch.mm(weight, xt)
    else:
        out = torch.addmm(bias[:, None], weight, xt)
    return out.t() if rows > 1 else out[:, :1].t()


# From this many rows a oneDNN-packed weight beats the unpacked path, until `measure_packed_rows`
# measures it on the CPU at hand (the engine does at startup). These defaults are a Zen 5's:
# float32 from 3 rows (MKL's skinny GEMM won below), bfloat16 from one row; a Sapphire Rapids
# measured float32 packed 2x faster at one row.
PACKED_MIN_ROWS = {torch.float32: 3, torch.bfloat16: 1}


@functools.cache
def onednn_pack_refusal(dtype: torch.dtype) -> str | None:
    """None when oneDNN packs and multiplies a `dtype` weight here, else its reason.

    Asked of oneDNN with a tiny weight, never read from the dtype or CPU flags: its bf16 reorder
    needs AVX512BW/VL/DQ or AVX-NE-CONVERT and raises on an AVX2-only CPU (Zen 3), and
    `ONEDNN_MAX_CPU_ISA` lowers what it will use below what the CPU has."""
    if dtype not in PACKED_MIN_ROWS:
        return f"oneDNN-packed weights are float32/bfloat16 only, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    w, x = torch.ones(16, 16, dtype=dtype), torch.ones(2, 16, dtype=dtype)
    try:
        with torch.inference_mode():
            y = onednn_linear(x, onednn_pack(w), None)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    if not torch.equal(y.float(), torch.full((2, 16), 16.0)):
        return "oneDNN's packed matmul gave a wrong product in the startup check"
    return None


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and onednn_pack_refusal(weight.dtype) is None


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (the batch-size hint picks the blocking;
    64 measured best for 4-256 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ a weight packed by `onednn_pack` (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class WeightOwner(Protocol):
    """A layer holding its dense weight and bias as parameters (models/linear/layer.py)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class DensePlain:
    """The float weight multiplied as it is (`cpu_linear`). It reads the layer's parameters at
    each call: they are materialised from the meta device, loaded and tied after the layer is
    built and this method chosen."""

    layer: WeightOwner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.layer.weight, self.layer.bias)

    def rows(self, index: slice | torch.Tensor, part: WeightOwner) -> DensePlain:
        return DensePlain(part)

    def pack(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class OneDNNPacked:
    """A weight in oneDNN's blocked layout (`onednn_pack`), for activations of its dtype; others
    take `fallback` (the weight multiplied as it is)."""

    packed: torch.Tensor
    bias: torch.Tensor | None  # in `dtype`
    dtype: torch.dtype
    # the weight multiplied as it is: a dense layer's own, a GGUF weight's dequantized
    fallback: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            return self.fallback(x)
        return onednn_linear(x, self.packed, self.bias)


@dataclass(slots=True)
class DenseWeight:
    """A float weight served plain below `packed_min_rows` rows and from its oneDNN-packed copy
    from there on (2-D activations; others plain)."""

    plain: DensePlain
    packed: OneDNNPacked
    packed_min_rows: int

    @staticmethod
    def of(layer: WeightOwner, packed_min_rows: int | None = None) -> DenseWeight:
        """`layer`'s weight packed now (a later weight change is not seen); from
        PACKED_MIN_ROWS rows until measured."""
        weight = layer.weight.detach()
        plain = DensePlain(layer)
        packed = OneDNNPacked(onednn_pack(weight), layer.bias, weight.dtype, plain)
        return DenseWeight(plain, packed, packed_min_rows or PACKED_MIN_ROWS[weight.dtype])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= self.packed_min_rows:
            return self.packed(x)
        return self.plain(x)

    def rows(self, index: slice | torch.Tensor, part: WeightOwner) -> DenseWeight:
        return DenseWeight.of(part, self.packed_min_rows)

    def pack(self) -> int:
        return 0  # packed already
