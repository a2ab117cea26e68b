"""The torch backend's paged prefill attention for CPU float32 and bfloat16: whether the C++ op
(kernels/cpu_prefill.cpp, compiled at first use; its build and fallback: kernels/build.py) serves
on this CPU, and what it multiplies with."""

from __future__ import annotations

from typing import Any

import torch

from kernels.ops import CPU_PREFILL


def load() -> Any:
    """The compiled ops (`.paged_prefill`, `.paged_prefill_tiles`, `.simd_width`), or None
    where they cannot be built or were built without AVX2 (width 0)."""
    ops = CPU_PREFILL.load()
    return ops if ops is not None and ops.simd_width() > 0 else None


def arithmetic(dtype: torch.dtype, op: Any = None) -> str:
    """What the op (`op`: the form that serves) multiplies with for queries of `dtype` (on a
    cache of the same dtype)."""
    ops = load()
    if ops is None:
        return "not built"
    if dtype == torch.bfloat16 and op is not None and op is ops.paged_prefill_tiles:
        return "bf16 tile GEMMs (brgemm)"
    if dtype == torch.bfloat16 and ops.bf16_dot():
        return "bf16 dot products"
    return f"float32 FMA, {ops.simd_width()} lanes"
