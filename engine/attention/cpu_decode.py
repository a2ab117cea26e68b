"""The torch backend's paged decode attention for CPU float32 and bfloat16, from cpu_decode.cpp
beside this file, compiled at first use (the build and its fallback: models/cpp_ext.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.cpp_ext import CppOps

_OPS = CppOps("kvserve_cpu_decode", Path(__file__).with_name("cpu_decode.cpp"))


def load() -> Any:
    """The compiled ops (`.paged_decode`), or None where they cannot be built."""
    return _OPS.load()
