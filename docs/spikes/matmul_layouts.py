"""Time the ways of multiplying activations by a model's weights on this CPU.

Weights are SmolLM2-135M's per-layer matrices (30 layers, 424 MB float32, far beyond cache), so the
figures are what one decode/verify/prefill step pays. Forms compared, for several row counts:
  x @ W_t       W stored transposed [in, out]
  F.linear      W stored [out, in]
  W @ x.T       W stored [out, in], x row-major (what models.layers.cpu_linear does; 1 row -> 2)

    python docs/spikes/matmul_layouts.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.linear.dense import cpu_linear

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (in, out) per matrix


def best_ms(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps * 1e3)
    return best


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(o, i) for i, o in SHAPES]
    weights_t = [w.t().contiguous() for w in weights]
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"{len(weights)} matrices, {mb:.0f} MB float32, {torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'x @ W_t':>10} {'F.linear':>10} {'W @ x.T':>10}   ms per pass")
    for rows in (1, 2, 3, 4, 5, 6, 8, 16, 64, 256):
        xs = {n: torch.randn(rows, n) for n in (576, 1536)}
        reps = 10 if rows <= 16 else 3
        a = best_ms(lambda xs=xs: [xs[w.shape[0]] @ w for w in weights_t], reps)
        b = best_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], reps)
        c = best_ms(lambda xs=xs: [cpu_linear(xs[w.shape[1]], w, None) for w in weights], reps)
        print(f"{rows:>5} {a:>10.1f} {b:>10.1f} {c:>10.1f}   ({mb / c:.1f} GB/s best form)")


if __name__ == "__main__":
    main()
