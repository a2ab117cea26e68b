"""A decode step's whole decoder stack in one C++ op (decode_stack.cpp beside this file, compiled
at first use; see models/cpp_ext.py): the same kernels the per-layer path calls, in the same
order, without Python between them. `LlamaForCausalLM.forward` uses it where it applies
(`LlamaForCausalLM._decode_stack`) and runs its layers one by one otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models import cpu_fused, gguf_linear
from models.cpp_ext import CppOps

_OPS = CppOps("kvserve_decode_stack", Path(__file__).with_name("decode_stack.cpp"))

# the block kernels the op calls, as decode_stack.cpp numbers them: float activations on the
# ggml blocks, int8 or float activations on the interleaved copy (gguf_q8.cpp)
FLOAT_ON_BLOCKS, INT8_INTERLEAVED, FLOAT_INTERLEAVED = 0, 1, 2


def load() -> Any:
    """The compiled op (`.forward`), or None where it or a kernel it calls cannot be built."""
    if cpu_fused.load() is None or gguf_linear.load() is None:
        return None
    return _OPS.load()


def kernel_kind(weights: list[gguf_linear.GGUFWeight], rows: int) -> int | None:
    """The block kernel every weight takes at `rows` rows, as `GGUFWeight.__call__` chooses it;
    None where they differ or one takes the dense path."""
    interleaved = all(w.interleaved is not None for w in weights)
    if all(rows <= w.q8_max_rows for w in weights):
        return INT8_INTERLEAVED if interleaved else None
    if all(w.q8_max_rows < rows <= w.kernel_max_rows for w in weights):
        return FLOAT_INTERLEAVED if interleaved else FLOAT_ON_BLOCKS
    return None


def operands(weights: list[gguf_linear.GGUFWeight], kind: int) -> list[torch.Tensor]:
    return [w.blocks if kind == FLOAT_ON_BLOCKS else w.interleaved for w in weights]  # type: ignore[misc]
