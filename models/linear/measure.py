"""What the startup measures of the linear methods on this CPU, and the row buckets it sets:
from how many rows a oneDNN-packed copy beats the plain product (`measure_packed_rows`), where
the GGUF block kernel (float or int8 activations) meets the dense path (`measure_crossover`),
and from how many rows int8 rows beat the float dense path (`measure_int8_dense`). Paths are
timed over a forward's weights in order, interleaved (`best_pass_times`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from models.linear import int8_prefill
from models.linear.dense import DenseWeight
from models.linear.gguf_linear import GGUFWeight, load_q8, served_weights, weight_groups
from models.linear.layer import Linear

# Row counts the startup probe compares the block kernel and the dense path at (a decode
# batch's sizes)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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
    layers = [m for m in module.modules() if isinstance(m, Linear)]
    weights = [(m.in_features, m.format) for m in layers if isinstance(m.format, DenseWeight)]
    if not weights:
        return ""
    seen, chosen = [], PACKED_ROW_BUCKETS[-1] + 1
    for rows in PACKED_ROW_BUCKETS:
        xs = {n: torch.randn(rows, n).to(w.packed.dtype) for n, w in weights}
        plain, packed = best_pass_times(
            [
                [(w.plain, xs[n]) for n, w in weights],
                [(w.packed, xs[n]) for n, w in weights],
            ]
        )
        seen.append(f"{rows}: {plain * 1e3:.1f}/{packed * 1e3:.1f}")
        if packed <= plain:
            chosen = rows
            break
    for _, w in weights:
        w.packed_min_rows = chosen
    return f"oneDNN-packed from {chosen} rows (ms plain/packed by rows {', '.join(seen)})"


def _best_times(weights: list[GGUFWeight], paths: list[str], rows: int) -> list[float]:
    """One pass over `weights` in forward order through each of `paths` (the methods
    "kernel", "kernel_q8", "dense" or "int8") at `rows` rows, interleaved (`best_pass_times`)."""
    xs = {
        w.kernel.in_features: torch.randn(rows, w.kernel.in_features).to(w.kernel.dtype)
        for w in weights
    }
    return best_pass_times(
        [[(getattr(w, p), xs[w.kernel.in_features]) for w in weights] for p in paths]
    )


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
            paths = ["kernel", "dense"] + (["kernel_q8"] if int8_activations else [])
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


# Row counts the int8 W8A8 dense path is timed at against the float one: wide decode steps
# (from the block kernel's usual limit on: SmolLM2 on Zen 4 wins from 32 rows) and prefill chunks
INT8_ROW_BUCKETS = (32, 48, 64, 256, 1024)
_MEASURED_INT8: dict[tuple, tuple[int, str]] = {}


@torch.inference_mode()
def measure_int8_dense(
    model: nn.Module, key: tuple | None = None, input_ranges: dict[str, torch.Tensor] | None = None
) -> str:
    """Give the decoder's GGUF weights int8 W8A8 copies (smoothed by `input_ranges`, max |x| per
    input channel by module name, where given) and time the dense path on them against
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
    ranges = input_ranges or {}
    copies = sum(
        w.make_int8(ranges.get(name))
        for name, w in served_weights(model)
        if not name.endswith("lm_head")
    )
    if key is not None and key in _MEASURED_INT8:
        start, text = _MEASURED_INT8[key]
    else:
        start, seen = 1 << 30, []
        for rows in reversed(INT8_ROW_BUCKETS):
            dense, int8 = _best_times(weights, ["dense", "int8"], rows)
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
