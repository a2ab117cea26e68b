"""The dense format: a float weight [out, in] multiplied by torch, plain or from a oneDNN-packed
copy, whichever the startup measurement found faster for the step's rows (`measure_packed_rows`).
`Linear` is the layer every model builds: it holds the dense weight and, where the weight is
served in another format, that format's method (`Linear.quant`: GGUF blocks, int8 W8A8), which
multiplies x itself.

Why the plain path computes `(W @ x.T).T` on CPU: with W stored [out, in] (HF layout) MKL runs
that as a GEMM with a skinny right-hand side, which reads weights at close to memory bandwidth
for 2-16 rows, while `x @ W.T` / `F.linear` at 2-16 rows runs 2-3x slower and a single row goes
down MKL's GEMV path at half the bandwidth. One row is therefore padded to two. Measured over
SmolLM2's 30 layers of weights (424 MB, out of cache) here: 1 row 27.5 ms (x @ W_t, the old
layout) -> 14.8 ms; 5 rows 41 -> 24 ms; 64 rows 119 -> 93 ms; 1024 rows equal
(`docs/spikes/matmul_layouts.py`). On CUDA `F.linear` is one cuBLAS call and is used as is.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.linear import LinearMethod


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias) -> [rows, out], the fastest form on CPU."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        # bf16 (unpacked only with --no-cpu-packed-weights): the (W @ x.T).T form is MKL's
        # float32 trick; oneDNN's bf16 F.linear measured as fast at 2-64 rows, faster at one
        return F.linear(x, weight, bias)
    # MKL's fast path wants x row-major (so x.t() is a transposed view) and at least two rows.
    rows = x.shape[0]
    xt = (x.contiguous() if rows > 1 else x.expand(2, -1).contiguous()).t()
    if bias is None:
        out = torch.mm(weight, xt)
    else:
        out = torch.addmm(bias[:, None], weight, xt)
    return out.t() if rows > 1 else out[:, :1].t()


# From this many rows a oneDNN-packed weight beats the unpacked path, until `measure_packed_rows`
# measures it on the CPU at hand (the engine does at startup). These defaults are a Zen 5's:
# float32 from 3 rows (MKL's skinny GEMM won below), bfloat16 from one row; a Sapphire Rapids
# measured float32 packed 2x faster at one row.
PACKED_MIN_ROWS = {torch.float32: 3, torch.bfloat16: 1}


@functools.cache
def onednn_pack_refusal(dtype: torch.dtype) -> str | None:
    """None when oneDNN packs and multiplies a `dtype` weight here, else its reason.

    Asked of oneDNN with a tiny weight, never read from the dtype or CPU flags: its bf16 reorder
    needs AVX512BW/VL/DQ or AVX-NE-CONVERT and raises on an AVX2-only CPU (Zen 3), and
    `ONEDNN_MAX_CPU_ISA` lowers what it will use below what the CPU has."""
    if dtype not in PACKED_MIN_ROWS:
        return f"oneDNN-packed weights are float32/bfloat16 only, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    w, x = torch.ones(16, 16, dtype=dtype), torch.ones(2, 16, dtype=dtype)
    try:
        with torch.inference_mode():
            y = onednn_linear(x, onednn_pack(w), None)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    if not torch.equal(y.float(), torch.full((2, 16), 16.0)):
        return "oneDNN's packed matmul gave a wrong product in the startup check"
    return None


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and onednn_pack_refusal(weight.dtype) is None


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (the batch-size hint picks the blocking;
    64 measured best for 4-256 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ a weight packed by `onednn_pack` (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # A oneDNN blocked copy of `weight` (CPU float32 or bfloat16; see `pack`), or None.
        self.packed: torch.Tensor | None = None
        self.packed_min_rows = 0
        # the weight in another format, whose method multiplies x itself (`serve`): int8 W8A8
        # (w8a8.py, --quantization int8) or GGUF blocks (gguf_linear.py); `weight` is then empty
        self.quant: LinearMethod | None = None

    def serve(self, method: LinearMethod) -> None:
        """Serve this layer from `method` (the weight in another format); the dense weight and
        its packed copy are dropped (a tied weight is kept by its other owner)."""
        self.quant = method
        self.packed = None
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack(self) -> int:
        """Also hold the weight in oneDNN's blocked layout for matmuls of >= PACKED_MIN_ROWS
        rows. Call after the weights are final (a later weight change is not seen). Returns
        the bytes added."""
        if self.quant is not None:  # a GGUF weight packs its own dense copy; int8 has none
            return self.quant.pack()
        if not can_pack(self.weight):
            return 0
        self.packed = onednn_pack(self.weight.detach())
        self.packed_min_rows = PACKED_MIN_ROWS[self.weight.dtype]
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x)
        packed = self.packed is not None and x.dim() == 2 and x.shape[0] >= self.packed_min_rows
        if packed and x.dtype == self.weight.dtype:
            return self.packed_forward(x)
        return self.plain_forward(x)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)

    def plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias)

    def rows(self, index: slice | torch.Tensor) -> Linear:
        """A Linear over output rows `index` of this one (a slice: views of its weight or a GGUF
        weight's blocks; row ids: copies), packed again if this one is."""
        part = Linear(self.in_features, 0, bias=self.bias is not None)
        if self.bias is not None:
            part.bias = nn.Parameter(self.bias.detach()[index], requires_grad=False)
        if self.quant is not None:
            part.quant = self.quant.rows(index)
            return part
        part.weight = nn.Parameter(self.weight.detach()[index], requires_grad=False)
        if self.packed is not None:
            part.pack()
            part.packed_min_rows = self.packed_min_rows
        return part

    def load_rows(self, start: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy an HF-layout weight [out_rows, in] into output rows [start, start + out_rows)."""
        rows = weight.shape[0]
        self.weight.data[start : start + rows].copy_(weight)
        if bias is not None:
            assert self.bias is not None
            self.bias.data[start : start + rows].copy_(bias)


def pack_linears(module: nn.Module) -> int:
    """`Linear.pack` every linear layer under `module` (each weight once, tied ones too)."""
    return sum(m.pack() for m in module.modules() if isinstance(m, Linear))


def best_pass_time(calls: list[tuple[Callable, torch.Tensor]], repeats: int = 3) -> float:
    """Best time of one pass through `calls` (fn, x) in order: a forward's stream of weights,
    mostly out of cache. The first pass allocates and warms the kernels, and is not counted."""
    return best_pass_times([calls], repeats)[0]


def best_pass_times(
    passes: list[list[tuple[Callable, torch.Tensor]]], repeats: int = 3
) -> list[float]:
    """`best_pass_time` of each of `passes` (the paths a crossover compares), timed in
    interleaved rounds so that load on a shared machine lands on every path alike rather
    than on whichever ran while a neighbour was busy."""
    best = [float("inf")] * len(passes)
    for i in range(repeats + 1):
        for j, calls in enumerate(passes):
            start = time.perf_counter()
            for fn, x in calls:
                fn(x)
            if i:
                best[j] = min(best[j], time.perf_counter() - start)
    return best


PACKED_ROW_BUCKETS = (1, 2, 3, 4, 8)


@torch.inference_mode()
def measure_packed_rows(module: nn.Module) -> str:
    """From how many rows the oneDNN-packed copies beat the plain matmul, measured here over all
    packed linear layers under `module` in forward order (PACKED_MIN_ROWS was measured on a
    Zen 5): the first of PACKED_ROW_BUCKETS where the packed pass is as fast, set on every packed
    layer. Returns the choice and times for the banner ("" when nothing is packed)."""
    layers = [m for m in module.modules() if isinstance(m, Linear) and m.packed is not None]
    if not layers:
        return ""
    seen, chosen = [], PACKED_ROW_BUCKETS[-1] + 1
    for rows in PACKED_ROW_BUCKETS:
        xs = {m.in_features: torch.randn(rows, m.in_features).to(m.weight.dtype) for m in layers}
        plain, packed = best_pass_times([
            [(m.plain_forward, xs[m.in_features]) for m in layers],
            [(m.packed_forward, xs[m.in_features]) for m in layers],
        ])  # fmt: skip
        seen.append(f"{rows}: {plain * 1e3:.1f}/{packed * 1e3:.1f}")
        if packed <= plain:
            chosen = rows
            break
    for m in layers:
        m.packed_min_rows = chosen
    return f"oneDNN-packed from {chosen} rows (ms plain/packed by rows {', '.join(seen)})"
