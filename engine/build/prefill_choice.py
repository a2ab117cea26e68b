"""Which CPU prefill attention serves: kvserve's C++ flash attention (kernels/
cpu_prefill.cpp) or torch's SDPA, by timing both at startup on this model's layer geometry.

Neither wins everywhere: on a Zen 5 (AVX512-BF16, no AMX) the C++ op took 0.37x SDPA's time on a
1,024-token causal chunk, while on a Sapphire Rapids with AMX torch's SDPA (its AMX tiles) took
about half the op's (10 vs 19 ms for 1,500 tokens, SmolLM2's heads, bf16). So the choice is
measured, like every other kernel choice, and the banner says which serves and by what times.
"""

from __future__ import annotations

import time

import torch

from engine.attention.torch_backend import TorchBackend
from engine.runner.step_inputs import step_metadata
from models.spec import ModelSpec

CHUNK = 512  # a fresh chunk, then one after as much context: both prefill shapes
# SDPA must beat the op by this factor to displace it: two timings on a shared machine should
# not flip the choice (and the float32 rounding with it) from one start to the next
SDPA_MARGIN = 1.25

# by (dtype, heads, kv heads, head_dim, block size): an engine built again in this process
# (tests, TP workers) reuses the verdict instead of re-timing noise
_CHOSEN: dict[tuple, tuple[bool, str]] = {}


@torch.inference_mode()
def choose_prefill_attention(
    backend: TorchBackend, spec: ModelSpec, dtype: torch.dtype, scratch_blocks: int
) -> str:
    """Time the C++ op and SDPA on the largest layer's geometry over scratch blocks (no request
    owns any yet); keep the op only where it is faster (else `backend.prefill_op` is cleared).
    Returns the kernel matrix's line ("" where there was nothing to choose)."""
    if backend.prefill_op is None:
        return ""
    if spec.group_specs:  # a model attending over its KV groups itself (DeepSeek V4)
        backend.prefill_op = None
        return f"{spec.architecture}'s own PyTorch attention over its compressed KV groups"
    bs = backend.block_size
    n = min(CHUNK, scratch_blocks * bs // 2)
    if n < bs:
        return ""
    layer = max(range(spec.num_layers), key=lambda i: spec.layers[i].num_heads)
    lay = spec.layers[layer]
    key = (dtype, lay.num_heads, lay.num_kv_heads, lay.head_dim, bs, n)
    if key not in _CHOSEN:
        _CHOSEN[key] = _time_both(backend, layer, dtype, n)
    keep, line = _CHOSEN[key]
    if not keep:
        backend.prefill_op = None
    return line


def _time_both(backend: TorchBackend, layer: int, dtype: torch.dtype, n: int) -> tuple[bool, str]:
    lay = backend.spec.layers[layer]
    table = list(range(-(-2 * n // backend.block_size)))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, lay.num_heads, lay.head_dim, generator=g).to(dtype)
    kv = torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=g).to(dtype)
    device = backend.kv_caches[0].device
    metas = [step_metadata([(table, start, n)], backend.block_size, device)[1] for start in (0, n)]
    op = backend.prefill_op

    def once(use_op: bool) -> float:
        backend.prefill_op = op if use_op else None
        t = time.perf_counter()
        for meta in metas:
            backend.plan(meta).forward(layer, q, kv, kv)
        return time.perf_counter() - t

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(4):  # interleaved, the first round a warm-up
        for use_op in (True, False):
            times[use_op].append(once(use_op))
    backend.prefill_op = op
    t_op, t_sdpa = (min(times[k][1:]) * 1e3 for k in (True, False))
    keep = t_op <= t_sdpa * SDPA_MARGIN
    served = "the C++ op" if keep else "torch SDPA"
    return keep, (
        f"{served} (measured: C++ {t_op:.1f} ms, SDPA {t_sdpa:.1f} ms for a {n}-token chunk "
        f"fresh and after {n} tokens, layer {layer}'s heads)"
    )
