"""A decode step's whole decoder stack in one C++ op (kernels/decode_stack.cpp, compiled at first
use with the ops it calls; see kernels/ops.py): the same kernels the per-layer path calls, in the
same order, without Python between them. `DecodeStack` decides per step whether it applies (the
model's layers all plain Llama layers on GGUF blocks taking the same block kernel at this row
count, the attention step able to give every layer's KV to one decode op); the model runs its
layers one by one where it does not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels.ops import DECODE_STACK
from models.layers import silu_mul
from models.linear import gguf_linear

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
    interleaved = all(w.kernel.interleaved is not None for w in weights)
    if all(rows <= w.q8_max_rows for w in weights):
        return INT8_INTERLEAVED if interleaved else None
    if all(w.q8_max_rows < rows <= w.kernel_max_rows for w in weights):
        return FLOAT_INTERLEAVED if interleaved else FLOAT_ON_BLOCKS
    return None


def operands(weights: list[gguf_linear.GGUFWeight], kind: int) -> list[torch.Tensor]:
    return [w.kernel.blocks if kind == FLOAT_ON_BLOCKS else w.kernel.interleaved for w in weights]  # type: ignore[misc]


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
            if not layer.plain_qkv or layer.moe is not None or layer.reduce is not None:
                return None
            if layer.attn_output_norm is not None or layer.act is not silu_mul:
                return None
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                # a step with LoRA adapters takes the per-layer path: the formats under serve
                w = linear.format
                if not isinstance(w, gguf_linear.GGUFWeight) or w.kernel.bias is not None:
                    return None
                weights.append(w)
        heads = {layer.layer.num_heads for layer in layers}
        if len(heads) != 1:
            return None
        return StackLayout(
            weights,
            [gguf_linear.FORMATS[w.kernel.format] for w in weights],
            [w.kernel.out_features for w in weights],
            [layer.input_layernorm.weight for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            heads.pop(),
        )


_UNREAD = object()  # DecodeStack's key before the layers are read


class DecodeStack:
    """A model's decode-stack op and its view of the layers (`StackLayout`), kept between steps:
    read again only when the layers' weights were replaced (GGUF blocks or int8 attached at
    load) or `forget` is called (reading took ~0.3 ms of every step in Python)."""

    def __init__(self) -> None:
        self._layout: StackLayout | None = None
        self._key: object = _UNREAD

    def forget(self) -> None:
        self._key = _UNREAD

    def __call__(
        self,
        layers: Sequence[Any],
        x: torch.Tensor,
        rope: dict[Any, tuple[torch.Tensor, torch.Tensor]],
        attn: Any,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(output, residual) of every layer in one op for a decode step of `layers` (one
        rotary table `rope`, attention step `attn`); None where that does not apply."""
        if len(rope) != 1 or x.dim() != 2 or x.device.type != "cpu":
            return None
        first = layers[0].qkv_proj.method
        if self._key is not first:
            self._layout, self._key = StackLayout.of(layers), first
        stack = self._layout
        if stack is None or stack.norm1[0].dtype != x.dtype:
            return None
        kind = kernel_kind(stack.weights, x.shape[0])
        if kind is None:
            return None
        ((cos, sin),) = rope.values()
        args = attn.decode_stack_args(cos, len(layers))
        ops = load() if args is not None else None
        if ops is None or args is None:
            return None
        return ops.forward(
            x,
            stack.norm1,
            stack.norm2,
            eps,
            operands(stack.weights, kind),
            kind,
            stack.fmts,
            stack.outs,
            args.kv_caches,
            cos,
            sin,
            args.slot_block,
            args.slot_offset,
            args.block_tables,
            args.seq_lens,
            stack.num_heads,
            args.scale,
            args.window,
        )
