"""The physical limit: this machine's float32 matmul rate and memory bandwidth (measured now,
with torch), the model's FLOPs and bytes per token, and the decode throughput ceiling at each
batch size: min(compute bound, bandwidth bound), where every step reads all weights once.

    python bench/roofline.py [--model PATH] [--context 384]
"""

from __future__ import annotations

import argparse
import time

import torch

from models.loader import default_model_path, load_spec


def matmul_gflops(k: int, n: int, batch: int, reps: int = 20) -> float:
    """The best float32 rate this machine's libraries reach at this shape: MKL's GEMM and
    oneDNN with a packed weight (what kvserve's linear layers use from 3 rows), best of
    several timings (the machine is shared)."""
    x, w = torch.randn(batch, k), torch.randn(n, k)
    forms = [lambda: w @ x.t()]
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        forms.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    best = float("inf")
    for form in forms:
        form()
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                form()
            best = min(best, (time.perf_counter() - t) / reps)
    return 2 * batch * k * n / best / 1e9


def read_gbps(mb: int = 512, reps: int = 5) -> float:
    """Streaming read bandwidth: a sum over a buffer far larger than the caches (a reduction
    reads each byte once and writes nothing, as a decode step reads weights)."""
    src = torch.ones(mb * 2**20 // 4)
    src.sum()
    best = float("inf")
    for _ in range(reps):  # the best of several: the machine is shared
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best / 1e9


def ceilings(spec, gflops: float, gbps: float, context: int) -> list[tuple[int, float, float]]:
    flops = spec.flops_per_token()
    weight_bytes = 4 * (flops // 2)  # one float32 weight per multiply-add
    kv_bytes = spec.kv_bytes_per_token(4) * context  # KV read per token per step
    rows = []
    for batch in (1, 4, 16, 64):
        t_compute = batch * flops / (gflops * 1e9)
        t_memory = (weight_bytes + batch * kv_bytes) / (gbps * 1e9)
        rows.append((batch, batch / max(t_compute, t_memory), batch / t_compute))
    return rows


def workload_ceiling(
    spec, gflops: float, gbps: float, batch: int, prompt_len: int, output_len: int
) -> float:
    """Output tokens/s ceiling of one wave of `batch` requests: compute-bound prefill (no
    lm_head but the last row), then `output_len` decode steps, each bound by compute or by
    reading all weights plus every sequence's KV at its current length."""
    flops, body = spec.flops_per_token(), spec.flops_per_token(include_lm_head=False)
    weight_bytes = 4 * (flops // 2)
    kv = spec.kv_bytes_per_token(4)
    seconds = batch * (prompt_len * body + flops) / (gflops * 1e9)
    for i in range(output_len):
        t_compute = batch * flops / (gflops * 1e9)
        t_memory = (weight_bytes + batch * kv * (prompt_len + i)) / (gbps * 1e9)
        seconds += max(t_compute, t_memory)
    return batch * output_len / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=384, help="mean context per sequence")
    ap.add_argument("--prompt", type=int, default=270, help="prompt tokens (workload ceiling)")
    args = ap.parse_args()
    spec = load_spec(args.model or default_model_path())
    lay = spec.layers[0]
    gflops = matmul_gflops(spec.hidden_size, lay.intermediate_size, 64)
    gbps = read_gbps()
    print(
        f"float32 matmul ({spec.hidden_size}x{lay.intermediate_size}, batch 64): "
        f"{gflops:.0f} GFLOP/s; memory read: {gbps:.1f} GB/s"
    )
    print(
        f"model: {spec.flops_per_token() / 1e6:.0f} MFLOP/token, "
        f"{2 * spec.flops_per_token() / 1e6:.0f} MB float32 weights read per step, "
        f"KV {spec.kv_bytes_per_token(4) / 1024:.0f} KiB/token"
    )
    print("batch  decode ceiling tok/s  (compute-only bound)")
    for batch, ceiling, compute in ceilings(spec, gflops, gbps, args.context):
        print(f"{batch:5d}  {ceiling:20.1f}  ({compute:.1f})")
    print(f"compare.py's workload ({args.prompt}-token prompts, 128 output tokens, one wave):")
    for c in (1, 4, 16, 64):
        tps = workload_ceiling(spec, gflops, gbps, c, args.prompt, 128)
        print(f"  concurrency {c:3d}: {tps:6.1f} output tok/s")


if __name__ == "__main__":
    main()
