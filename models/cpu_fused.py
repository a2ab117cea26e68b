"""The fused elementwise ops of models/layers.py (residual add + RMSNorm, SiLU x up) for CPU
float32 and bfloat16 (computed in float32), from cpu_fused.cpp beside this file, compiled at first
use (see models/cpp_ext.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.cpp_ext import CppOps

_OPS = CppOps("kvserve_cpu_fused", Path(__file__).with_name("cpu_fused.cpp"))


def load() -> Any:
    """The compiled ops (`.add_rms_norm`, `.silu_mul`), or None where they cannot be built."""
    return _OPS.load()
