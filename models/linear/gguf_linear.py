"""A GGUF checkpoint's quantized matrices served as the file stores them (Q4_0, Q4_1, Q8_0):
`GGUFBlocks` is a linear layer's weight as ggml blocks, multiplied by kernels/gguf_linear.cpp's
kernel for few rows (decode: the time is the weights' bytes, 4-6x fewer than float32);
`GGUFWeight` serves those rows from it and many from a dense method (prefill: a dense GEMM wins
once the dequantization is spread over enough rows) or int8 rows. Where they meet is measured
at startup on this CPU (models/linear/measure.py `measure_crossover`), never assumed.
Activations stay in the serving dtype; the kernel computes in float32, so its product is the
dequantized float32 model's up to summation order."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from kernels.ops import GGUF, GGUF_Q8
from models.linear import int8_prefill
from models.linear.dense import OneDNNPacked, can_pack, cpu_linear, onednn_pack
from models.linear.int8_prefill import Int8Weight
from models.linear.layer import Linear

# ggml's type ids, as gguf.GGMLQuantizationType numbers them, and bytes per block of 32
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def load() -> Any:
    """The compiled ops (`.linear`, `.dequantize`), or None where they cannot be built."""
    return GGUF.load()


@functools.cache  # called per linear call on the hot path: decided once
def load_q8() -> Any:
    """The kernels on the interleaved copy (`.repack`, `.linear_float`, `.linear` on int8
    activations, `.lanes`), or None where they cannot be built or this CPU has no AVX2
    (`lanes() == 0`)."""
    ops = GGUF_Q8.load()
    return ops if ops is not None and ops.lanes() > 0 else None


def gguf_weights(model: nn.Module) -> list[GGUFWeight]:
    """The model's linear weights served from GGUF blocks, in module order."""
    return [w for _, w in served_weights(model)]


def served_weights(model: nn.Module) -> list[tuple[str, GGUFWeight]]:
    """(module name, its GGUF weight) of every `Linear` served from blocks, in module order."""
    found = []
    for name, module in model.named_modules():
        method = module.format if isinstance(module, Linear) else None
        if isinstance(method, GGUFWeight):
            found.append((name, method))
    return found


@dataclass(slots=True)
class GGUFBlocks:
    """One linear layer's weight as ggml blocks (`blocks` uint8 [out_features, bytes per row])
    multiplied by the block kernel on float activations (in x's dtype, computed in float32)."""

    format: str
    blocks: torch.Tensor
    in_features: int
    out_features: int
    dtype: torch.dtype  # the serving dtype: activations in and out, and a dense copy's
    bias: torch.Tensor | None = None  # float32
    # the blocks repacked for kernels/gguf_q8.cpp's kernels (`interleave`: NR rows per vector
    # lane), which serve both float and int8 activations where built (AVX2); else the blocks serve
    interleaved: torch.Tensor | None = None

    def rows(self, index: slice | torch.Tensor, part: object = None) -> GGUFBlocks:
        """Output rows `index` (a slice: views of the blocks; row ids: a copy), interleaved
        again if these are (block rows are independent)."""
        blocks = self.blocks[index]
        bias = None if self.bias is None else self.bias[index]
        cut = replace(
            self, blocks=blocks, out_features=blocks.shape[0], bias=bias, interleaved=None
        )
        if self.interleaved is not None:
            cut.interleave()
        return cut

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`."""
        w = load().dequantize(self.blocks, FORMATS[self.format], self.in_features)
        return w if dtype == torch.float32 else w.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved is not None:
            y = load_q8().linear_float(x, self.interleaved, FORMATS[self.format], self.out_features)
        else:
            y = load().linear(x, self.blocks, FORMATS[self.format])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def interleave(self) -> int:
        """Hold the blocks repacked for kernels/gguf_q8.cpp's kernels; returns its bytes (0 where
        they are not built here)."""
        ops = load_q8()
        if ops is None:
            return 0
        self.interleaved = ops.repack(self.blocks, FORMATS[self.format])
        return self.interleaved.numel()

    def pack(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class Int8Activations:
    """The block kernel on int8-rounded activations (llama.cpp's numerics), on the interleaved
    copy of `blocks`."""

    blocks: GGUFBlocks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.blocks
        assert w.interleaved is not None, "interleave() first"
        y = load_q8().linear(x, w.interleaved, FORMATS[w.format], w.out_features)
        return y if w.bias is None else y + w.bias.to(y.dtype)


@dataclass(frozen=True, slots=True)
class Dequantized:
    """The blocks dequantized at each call and multiplied as a dense weight (`cpu_linear`;
    F.linear for bf16): the dense path where no packed copy is held."""

    blocks: GGUFBlocks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.blocks.bias is None else self.blocks.bias.to(x.dtype)
        return cpu_linear(x, self.blocks.dequantized(x.dtype), bias)


@dataclass(slots=True)
class GGUFWeight:
    """A weight from GGUF blocks as served: its methods, and which takes a step's rows.
    2-D x of up to `q8_max_rows` rows: the block kernel on int8-rounded activations; up to
    `kernel_max_rows`: on float32 activations (exact); more (or other shapes, flattened): the
    dense method, or int8 rows from `int8_min_rows` rows where held."""

    kernel: GGUFBlocks
    kernel_q8: Int8Activations
    dense: OneDNNPacked | Dequantized
    int8: Int8Weight | None = None
    q8_max_rows: int = 0
    kernel_max_rows: int = 8
    int8_min_rows: int = 1 << 30

    @staticmethod
    def of(kernel: GGUFBlocks, kernel_max_rows: int = 8) -> GGUFWeight:
        """`kernel`'s blocks served by the kernel up to `kernel_max_rows` (until measured),
        dequantized at each call above (until packed)."""
        return GGUFWeight(
            kernel, Int8Activations(kernel), Dequantized(kernel), kernel_max_rows=kernel_max_rows
        )

    def rows(self, index: slice | torch.Tensor, part: object = None) -> GGUFWeight:
        """Output rows `index` as a weight of their own, with this one's row limits and copies
        (a packed dense copy, int8 rows) made again for them."""
        kernel = self.kernel.rows(index)
        cut = replace(
            self,
            kernel=kernel,
            kernel_q8=Int8Activations(kernel),
            dense=Dequantized(kernel),
            int8=None,
        )
        if self.int8 is not None:
            cut.int8 = self.int8.rows(index)
        if isinstance(self.dense, OneDNNPacked):
            cut.pack()
        return cut

    def pack(self) -> int:
        """Hold a oneDNN-packed dense copy in the serving dtype for the dense path, where oneDNN
        packs that dtype here. Returns its bytes."""
        w = self.kernel
        if not can_pack(torch.empty(0, dtype=w.dtype)):
            return 0
        if not isinstance(self.dense, OneDNNPacked):  # (one held already stays: blocks are fixed)
            bias = None if w.bias is None else w.bias.to(w.dtype)
            packed = onednn_pack(w.dequantized(w.dtype))
            self.dense = OneDNNPacked(packed, bias, w.dtype, Dequantized(w))
        return w.out_features * w.in_features * w.dtype.itemsize

    def make_int8(self, input_range: torch.Tensor | None = None) -> int:
        """Hold the int8 W8A8 copy (the blocks dequantized, rounded per output channel; smoothed
        where `input_range`, max |x| per input channel on calibration text, is given); returns
        its bytes (0 where its ops are not built here)."""
        if int8_prefill.load() is None:
            return 0
        dense = self.kernel.dequantized(torch.float32)
        smoothing = None if input_range is None else int8_prefill.smoothing_for(input_range, dense)
        self.int8 = Int8Weight.from_dense(dense, self.kernel.bias, smoothing)
        return self.int8.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.kernel_max_rows:
            return self.kernel_q8(x) if x.shape[0] <= self.q8_max_rows else self.kernel(x)
        flat = x.reshape(-1, x.shape[-1])
        if self.int8 is not None and flat.shape[0] >= self.int8_min_rows:
            return self.int8(flat).reshape(*x.shape[:-1], -1)
        return self.dense(flat).reshape(*x.shape[:-1], -1)


def attach(model: nn.Module, blocks: dict[str, tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Serve every `Linear` whose weight has blocks (by parameter name) from them; its dense
    weight is dropped (a tied embedding keeps its own). Returns bytes of blocks per format."""
    held: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or f"{name}.weight" not in blocks:
            continue
        fmt, data = blocks[f"{name}.weight"]
        out_features, in_features = module.weight.shape
        if data.shape[0] != out_features or data.shape[1] * 32 != in_features * BLOCK_BYTES[fmt]:
            raise ValueError(f"{name}: {fmt} blocks {tuple(data.shape)} do not fit its weight")
        bias = None if module.bias is None else module.bias.detach().float()
        kernel = GGUFBlocks(
            fmt, data.contiguous(), in_features, out_features, module.weight.dtype, bias
        )
        kernel.interleave()
        module.serve(GGUFWeight.of(kernel))
        held[fmt] = held.get(fmt, 0) + data.numel()
    return held


def quantize_to_blocks(
    model: nn.Module, fmt: str, head_fmt: str = "Q8_0"
) -> dict[str, tuple[str, torch.Tensor]]:
    """Every float `Linear` weight whose rows are whole blocks of 32, rounded to ggml blocks of
    `fmt` (the lm_head to `head_fmt`) with the `gguf` package's quantizer, by parameter name (for
    `attach`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not module.dense or module.in_features % 32:
            continue
        kind = head_fmt if name.endswith("lm_head") else fmt
        weight = module.weight.detach().float().numpy()
        raw = quantize(weight, GGMLQuantizationType[kind])
        blocks[f"{name}.weight"] = (kind, torch.from_numpy(raw))
    return blocks


def weight_groups(model: nn.Module) -> dict[str, list[GGUFWeight]]:
    """The model's GGUF weights in forward order, as the probes time them: "decoder layers" and
    "lm_head" (another shape and format)."""
    groups: dict[str, list[GGUFWeight]] = {}
    for name, weight in served_weights(model):
        group = "lm_head" if name.endswith("lm_head") else "decoder layers"
        groups.setdefault(group, []).append(weight)
    return groups
