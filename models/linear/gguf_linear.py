"""A GGUF checkpoint's quantized matrices served as the file stores them (Q4_0, Q4_1, Q8_0):
`GGUFWeight` is a linear layer's weight as ggml blocks, multiplied by kernels/gguf_linear.cpp's
kernel for few rows (decode: the time is the weights' bytes, 4-6x fewer than float32) and
dequantized into a dense matrix for many (prefill: a dense GEMM wins once the dequantization is
spread over enough rows). Where the two meet is measured at startup on this CPU
(`measure_crossover`), never assumed. Activations stay in the serving dtype; the kernel computes
in float32, so its product is the dequantized float32 model's up to summation order."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from kernels.ops import GGUF, GGUF_Q8
from models.linear import int8_prefill
from models.linear.dense import (
    Linear,
    best_pass_times,
    can_pack,
    cpu_linear,
    onednn_linear,
    onednn_pack,
)
from models.linear.int8_prefill import Int8Weight

# ggml's type ids, as gguf.GGMLQuantizationType numbers them, and bytes per block of 32
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# Row counts the startup probe compares the two paths at (a decode batch's sizes)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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
    return [m.quant for m in model.modules() if isinstance(getattr(m, "quant", None), GGUFWeight)]


@dataclass(slots=True)
class GGUFWeight:
    """One linear layer's weight as ggml blocks: `blocks` uint8 [out_features, bytes per row]."""

    format: str
    blocks: torch.Tensor
    in_features: int
    out_features: int
    dtype: torch.dtype  # the serving dtype: activations in and out, and the dense copy's
    bias: torch.Tensor | None = None
    # rows <= q8_max_rows: the block kernel on int8-rounded activations (llama.cpp's numerics);
    # <= kernel_max_rows: the block kernel on float32 activations (exact); more: the dense path
    q8_max_rows: int = 0
    kernel_max_rows: int = 8
    # oneDNN-packed dense copy for many rows (`pack`, --cpu-packed-weights); without it each
    # dense call dequantizes the blocks first
    packed: torch.Tensor | None = None
    # the blocks repacked for kernels/gguf_q8.cpp's kernels (`interleave`: NR rows per vector lane),
    # which serve both float and int8 activations where built (AVX2); else the blocks serve
    interleaved: torch.Tensor | None = None
    # from int8_min_rows rows on, the dense path on an int8 W8A8 copy (`make_int8`; the startup
    # measurement and accuracy judge decide: engine/weights/quantization.py)
    int8: Int8Weight | None = None
    int8_min_rows: int = 1 << 30

    def rows(self, index: slice | torch.Tensor) -> GGUFWeight:
        """Output rows `index` (a slice: views of the blocks; row ids: a copy) as a weight of
        their own, with this one's row limits (block rows are independent); a packed dense copy
        is made again for them if this one has one."""
        blocks = self.blocks[index]
        part = replace(
            self, blocks=blocks, out_features=blocks.shape[0], packed=None, interleaved=None,
            bias=None if self.bias is None else self.bias[index], int8=None,
        )  # fmt: skip
        if self.int8 is not None:
            part.make_int8()
        if self.packed is not None:
            part.pack()
        if self.interleaved is not None:
            part.interleave()
        return part

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight [out, in] in `dtype`."""
        w = load().dequantize(self.blocks, FORMATS[self.format], self.in_features)
        return w if dtype == torch.float32 else w.to(dtype)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The block kernel on float activations (in x's dtype, computed in float32)."""
        if self.interleaved is not None:
            y = load_q8().linear_float(x, self.interleaved, FORMATS[self.format], self.out_features)
        else:
            y = load().linear(x, self.blocks, FORMATS[self.format])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def kernel_q8(self, x: torch.Tensor) -> torch.Tensor:
        """The block kernel on int8-rounded activations (needs `interleave`)."""
        assert self.interleaved is not None, "interleave() first"
        y = load_q8().linear(x, self.interleaved, FORMATS[self.format], self.out_features)
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
        """Hold a oneDNN-packed dense copy in the serving dtype for the dense path, where oneDNN
        packs that dtype here. Returns its bytes."""
        if not can_pack(torch.empty(0, dtype=self.dtype)):
            return 0
        if self.packed is None:  # (one held already stays: the blocks never change)
            self.packed = onednn_pack(self.dense(self.dtype))
        return self.out_features * self.in_features * self.dtype.itemsize

    def make_int8(self) -> int:
        """Hold the int8 W8A8 copy (the blocks dequantized, rounded per output channel); returns
        its bytes (0 where its ops are not built here)."""
        if int8_prefill.load() is None:
            return 0
        self.int8 = Int8Weight.from_dense(self.dense(torch.float32))
        return self.int8.nbytes

    def dense_int8(self, x: torch.Tensor) -> torch.Tensor:
        assert self.int8 is not None, "make_int8() first"
        return self.int8.matmul(x, self.bias)

    def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.packed is not None and x.dtype == self.dtype:
            return onednn_linear(x, self.packed, bias)
        return cpu_linear(x, self.dense(x.dtype), bias)  # F.linear for bf16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.kernel_max_rows:
            return self.kernel_q8(x) if x.shape[0] <= self.q8_max_rows else self.kernel(x)
        flat = x.reshape(-1, x.shape[-1])
        if self.int8 is not None and flat.shape[0] >= self.int8_min_rows:
            return self.dense_int8(flat).reshape(*x.shape[:-1], -1)
        return self.dense_matmul(flat).reshape(*x.shape[:-1], -1)


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
        weight = GGUFWeight(
            fmt, data.contiguous(), in_features, out_features, module.weight.dtype, bias
        )
        weight.interleave()
        module.serve(weight)
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
        if not isinstance(module, Linear) or module.quant is not None or module.in_features % 32:
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
    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant", None), GGUFWeight):
            group = "lm_head" if name.endswith("lm_head") else "decoder layers"
            groups.setdefault(group, []).append(module.quant)
    return groups


def _best_times(weights: list[GGUFWeight], paths: list[str], rows: int) -> list[float]:
    """One pass over `weights` in forward order through each of `paths` ("kernel",
    "kernel_q8" or "dense_matmul") at `rows` rows, interleaved (`best_pass_times`)."""
    xs = {w.in_features: torch.randn(rows, w.in_features).to(w.dtype) for w in weights}
    return best_pass_times([[(getattr(w, p), xs[w.in_features]) for w in weights] for p in paths])


# int8-rounded activations cost accuracy (~0.5% relative error per product): they must beat
# the exact paths by this factor to be chosen
Q8_MARGIN = 1.1
# the dense path must beat the block kernel by this factor to take its rows: a tie is no
# evidence (two paths timed alike while a neighbour held the CPU: 2171.9 vs 2165.8 ms for one
# row, when a quiet pass is ~10 ms), and the kernel reads a quarter of the dense copy's bytes
DENSE_MARGIN = 1.05


# Crossovers measured in this process, by what they depend on (the caller's key): an engine built
# again on the same weights and settings (tests, notebooks) takes them instead of timing again.
_MEASURED: dict[tuple, tuple[dict[str, tuple[int, int]], str]] = {}


@torch.inference_mode()
def measure_crossover(
    model: nn.Module,
    dtype: torch.dtype,
    int8_activations: bool = False,
    key: tuple | None = None,
    q8_min_rows: int = 0,
) -> str:
    """Time the three paths at ROW_BUCKETS, over all the decoder's GGUF weights in forward order
    and over the lm_head apart (another shape and format, its own crossover): the block kernel on
    int8-rounded activations, on float32 activations, and the dense path (the packed copy, or
    dequantize + GEMM). Each group takes, bucket by bucket from one row, the fastest (the dense
    path by DENSE_MARGIN, int8
    activations only with `int8_activations` and by Q8_MARGIN: they round activations the way
    llama.cpp does, and flip near-tied tokens), until the dense path wins; its weights'
    `q8_max_rows` and
    `kernel_max_rows` are set from that; a group that takes int8 activations takes them up to
    at least `q8_min_rows`. Returns the choices and times, for the banner."""
    groups = weight_groups(model)
    int8_activations = int8_activations and load_q8() is not None
    if key is not None and key in _MEASURED:
        limits, text = _MEASURED[key]
        for group, weights in groups.items():
            for w in weights:
                w.q8_max_rows, w.kernel_max_rows = limits[group]
        return text
    lines = []
    limits: dict[str, tuple[int, int]] = {}
    for group, weights in groups.items():
        q8_limit = kernel_limit = 0
        seen = []
        for rows in ROW_BUCKETS:
            # int8-rounded activations are timed only when allowed (the probe runs at startup)
            paths = ["kernel", "dense_matmul"] + (["kernel_q8"] if int8_activations else [])
            exact, dense, *rest = _best_times(weights, paths, rows)
            times = f"{exact * 1e3:.1f}/{dense * 1e3:.1f}"
            q8 = rest[0] if rest else float("inf")
            seen.append(f"{rows}: {times}" + (f"/{q8 * 1e3:.1f}" if int8_activations else ""))
            if q8 * Q8_MARGIN < min(exact, dense) and q8_limit == kernel_limit:
                q8_limit = kernel_limit = rows
            elif exact <= dense * DENSE_MARGIN:
                kernel_limit = rows
            else:
                break
        if q8_limit:
            # a verify step's rows take the kernel a single decode row takes, or speculation
            # would not reproduce plain decoding (the two numerics differ near ties)
            q8_limit = kernel_limit = max(q8_limit, q8_min_rows)
        for w in weights:
            w.q8_max_rows, w.kernel_max_rows = q8_limit, kernel_limit
        limits[group] = (q8_limit, kernel_limit)
        paths = "float/dense" + ("/int8-activation" if int8_activations else "")
        lines.append(
            f"{group} ({len(weights)} weights): block kernel up to {kernel_limit} rows"
            + (f" (int8 activations up to {q8_limit})" if int8_activations else "")
            + f", dense above (ms {paths} by rows {', '.join(seen)})"
        )
    text = "; ".join(lines)
    if key is not None:
        _MEASURED[key] = (limits, text)
    return text


# Row counts the int8 W8A8 dense path is timed at against the float one (prefill chunks)
INT8_ROW_BUCKETS = (64, 256, 1024)
_MEASURED_INT8: dict[tuple, tuple[int, str]] = {}


@torch.inference_mode()
def measure_int8_dense(model: nn.Module, key: tuple | None = None) -> str:
    """Give the decoder's GGUF weights int8 W8A8 copies and time the dense path on them against
    the float one at INT8_ROW_BUCKETS (all weights in forward order). They serve from the
    smallest bucket from which they win at every larger one by Q8_MARGIN (they round
    activations); where they never win, the copies are dropped. The lm_head keeps the float
    path (a prefill computes its logits for a few rows). Returns the choice, for the banner."""
    weights = weight_groups(model).get("decoder layers", [])
    if not weights:
        return ""
    if int8_prefill.load() is None:
        why = (
            "torch._int_mm is not exact on this CPU (int16 sums without VNNI)"
            if not int8_prefill.int_mm_exact()
            else "its C++ ops cannot be built"
        )
        return f"int8 W8A8 dense path unavailable: {why}"
    copies = sum(w.make_int8() for w in weights)
    if key is not None and key in _MEASURED_INT8:
        start, text = _MEASURED_INT8[key]
    else:
        start, seen = 1 << 30, []
        for rows in reversed(INT8_ROW_BUCKETS):
            dense, int8 = _best_times(weights, ["dense_matmul", "dense_int8"], rows)
            seen.append(f"{rows}: {dense * 1e3:.1f}/{int8 * 1e3:.1f}")
            if int8 * Q8_MARGIN >= dense:
                break
            start = rows
        times = f"ms float/int8 by rows {', '.join(reversed(seen))}"
        text = (
            f"int8 W8A8 dense path from {start} rows ({copies / 2**20:.0f} MiB of copies; {times})"
            if start < 1 << 30
            else f"int8 W8A8 dense path not faster here ({times})"
        )
        if key is not None:
            _MEASURED_INT8[key] = (start, text)
    for w in weights:
        w.int8_min_rows = start
        if start == 1 << 30:
            w.int8 = None
    return text
