"""The torch backend's paged decode attention for CPU float32 and bfloat16 (on a float32, bf16 or
int8 cache: kv_int8.h), from cpu_decode.cpp beside this file, compiled at first use (the build
and its fallback: models/cpp_ext.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.cpp_ext import CppOps

_HERE = Path(__file__).parent
_OPS = CppOps(
    "kvserve_cpu_decode",
    _HERE / "cpu_decode.cpp",
    tuple(_HERE / h for h in ("kv_int8.h", "cpu_simd.h", "decode_attend.h")),
)


def load() -> Any:
    """The compiled ops (`.paged_decode`), or None where they cannot be built."""
    return _OPS.load()
