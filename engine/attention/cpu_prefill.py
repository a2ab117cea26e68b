"""The torch backend's paged prefill attention for CPU float32 and bfloat16, from cpu_prefill.cpp
beside this file, compiled at first use (the build and its fallback: models/cpp_ext.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.cpp_ext import CppOps

_HERE = Path(__file__).parent
_OPS = CppOps(
    "kvserve_cpu_prefill", _HERE / "cpu_prefill.cpp", (_HERE / "cpu_simd.h", _HERE / "kv_int8.h")
)


def load() -> Any:
    """The compiled ops (`.paged_prefill`, `.simd_width`), or None where they cannot be built
    or were built without AVX2 (width 0)."""
    ops = _OPS.load()
    return ops if ops is not None and ops.simd_width() > 0 else None


def arithmetic(dtype: torch.dtype) -> str:
    """What the op multiplies with for queries of `dtype` (on a cache of the same dtype)."""
    ops = load()
    if ops is None:
        return "not built"
    if dtype == torch.bfloat16 and ops.bf16_dot():
        return "bf16 dot products"
    return f"float32 FMA, {ops.simd_width()} lanes"
