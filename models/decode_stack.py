"""A decode step's whole decoder stack in one C++ op (kernels/decode_stack.cpp, compiled at
first use with the ops it calls; see kernels/ops.py): the same kernels the per-layer path calls,
in the same order, without Python between them. `LlamaForCausalLM.forward` uses it where it applies
(`LlamaForCausalLM._decode_stack`) and runs its layers one by one otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels.ops import DECODE_STACK
from models import gguf_linear
from models.layers import silu_mul

# the block kernels the op calls, as kernels/decode_stack.cpp numbers them: float activations on
# the ggml blocks, int8 or float activations on the interleaved copy (kernels/gguf_q8.cpp)
FLOAT_ON_BLOCKS, INT8_INTERLEAVED, FLOAT_INTERLEAVED = 0, 1, 2


def load() -> Any:
    """The compiled op (`.forward`), or None where it or an op it calls (its `needs`: the
    fused norms, the block kernels, decode attention) cannot be built."""
    return DECODE_STACK.load()


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


@dataclass(frozen=True, slots=True)
class StackLayout:
    """What the op takes of a model's layers that does not change from step to step: the linear
    weights (qkv, o, gate_up, down per layer), their formats and output sizes, the norms' weights
    and the head count."""

    weights: list[gguf_linear.GGUFWeight]
    fmts: list[int]
    outs: list[int]
    norm1: list[torch.Tensor]
    norm2: list[torch.Tensor]
    num_heads: int

    @staticmethod
    def of(layers: Sequence[Any]) -> StackLayout | None:
        """The layout of `layers` (models/llama.py's DecoderLayer), or None where one of them is
        not a plain Llama layer on GGUF blocks without biases."""
        weights: list[gguf_linear.GGUFWeight] = []
        for layer in layers:
            if not layer.fused_rope or layer.moe is not None or layer.reduce is not None:
                return None
            if layer.attn_output_norm is not None or layer.act is not silu_mul:
                return None
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                w = getattr(linear, "quant", None)
                if not isinstance(w, gguf_linear.GGUFWeight) or w.bias is not None:
                    return None
                weights.append(w)
        heads = {layer.layer.num_heads for layer in layers}
        if len(heads) != 1:
            return None
        return StackLayout(
            weights,
            [gguf_linear.FORMATS[w.format] for w in weights],
            [w.out_features for w in weights],
            [layer.input_layernorm.weight for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            heads.pop(),
        )
