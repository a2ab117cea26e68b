"""Which CPU prefill attention serves: kvserve's C++ flash attention (kernels/
cpu_prefill.cpp; for bf16 queries also its tile-GEMM form, Q K^T and P V through PyTorch's
brgemm: AMX tiles where the CPU has them) or torch's SDPA, by timing them at startup on this
model's layer geometry.

Neither wins everywhere: on a Zen 5 (AVX512-BF16, no AMX) the C++ op took 0.37x SDPA's time on a
1,024-token causal chunk, while on a Sapphire Rapids with AMX torch's SDPA (its AMX tiles) took
about half the op's (10 vs 19 ms for 1,500 tokens, SmolLM2's heads, bf16). So the choice is
measured, like every other kernel choice, and the banner says which serves and by what times.
"""

from __future__ import annotations

import os
import time

import torch

from engine.attention import cpu_prefill
from engine.attention.torch_backend import TorchBackend
from engine.runner.step_inputs import step_metadata
from models.linear.dense import onednn_pack_refusal
from models.spec import ModelSpec

CHUNK = 512  # a fresh chunk, then one after as much context: both prefill shapes
# SDPA must beat the op by this factor to displace it: two timings on a shared machine should
# not flip the choice (and the float32 rounding with it) from one start to the next
SDPA_MARGIN = 1.25

# by (dtype, heads, kv heads, head_dim, block size): an engine built again in this process
# (tests, TP workers) reuses the verdict instead of re-timing noise
_CHOSEN: dict[tuple, tuple[str, str]] = {}


@torch.inference_mode()
def choose_prefill_attention(
    backend: TorchBackend, spec: ModelSpec, dtype: torch.dtype, scratch_blocks: int
) -> str:
    """Time the C++ op (and its tile-GEMM form for bf16) and SDPA on the largest layer's
    geometry over scratch blocks (no request owns any yet); `backend.prefill_op` becomes the
    faster form of the op, or is cleared where SDPA beats it. Returns the kernel matrix's line
    ("" where there was nothing to choose)."""
    if backend.prefill_op is None:
        return ""
    if spec.group_specs:  # a model attending over its KV groups itself (DeepSeek V4)
        backend.prefill_op = None
        return (
            f"{spec.architecture}'s own PyTorch attention over its compressed KV groups "
            "(its decode rows: the decode step's line)"
        )
    bs = backend.block_size
    n = min(CHUNK, scratch_blocks * bs // 2)
    if n < bs:
        return ""
    layer = max(range(spec.num_layers), key=lambda i: spec.layers[i].num_heads)
    lay = spec.layers[layer]
    key = (dtype, lay.num_heads, lay.num_kv_heads, lay.head_dim, bs, n)
    if key not in _CHOSEN:
        _CHOSEN[key] = _time_both(backend, layer, dtype, n)
    chosen, line = _CHOSEN[key]
    backend.prefill_op = _forms(backend.prefill_op, dtype).get(chosen)
    return line


def _forms(op, dtype: torch.dtype) -> dict[str, object]:
    """The op's forms for queries of `dtype`, by the banner's name (SDPA's is None)."""
    forms: dict[str, object] = {"the C++ op": op, "torch SDPA": None}
    ops = cpu_prefill.load()
    if dtype == torch.bfloat16 and ops is not None and ops.tiles() and not tile_gemm_refusal():
        forms["the C++ op on tile GEMMs"] = ops.paged_prefill_tiles
    return forms


# oneDNN ISA ceilings under which its bf16 brgemm ukernel runs (ONEDNN_MAX_CPU_ISA's values)
BF16_BRGEMM_ISAS = (
    "ALL",
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
)


def tile_gemm_refusal() -> str | None:
    """Why oneDNN's bf16 brgemm cannot run here although the op was built for AVX512-BF16, or
    None. A brgemm that oneDNN refuses throws inside the op's parallel region and aborts the
    process, so it is never timed where oneDNN's bf16 kernels are held back: ONEDNN_MAX_CPU_ISA
    below AVX512_CORE_BF16, or oneDNN refusing a bf16 weight reorder (as on an AVX2-only CPU)."""
    ceiling = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if ceiling not in BF16_BRGEMM_ISAS:
        return f"ONEDNN_MAX_CPU_ISA={ceiling} holds oneDNN below AVX512_CORE_BF16"
    return onednn_pack_refusal(torch.bfloat16)


def _time_both(backend: TorchBackend, layer: int, dtype: torch.dtype, n: int) -> tuple[str, str]:
    lay = backend.spec.layers[layer]
    table = list(range(-(-2 * n // backend.block_size)))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, lay.num_heads, lay.head_dim, generator=g).to(dtype)
    kv = torch.randn(n, lay.num_kv_heads, lay.head_dim, generator=g).to(dtype)
    device = backend.kv_caches[0].device
    metas = [step_metadata([(table, start, n)], backend.block_size, device)[1] for start in (0, n)]
    op = backend.prefill_op
    forms = _forms(op, dtype)

    def once(form: object) -> float:
        backend.prefill_op = form
        t = time.perf_counter()
        for meta in metas:
            backend.plan(meta).forward(layer, q, kv, kv)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(4):  # interleaved, the first round a warm-up
        for name, form in forms.items():
            times[name].append(once(form))
    backend.prefill_op = op
    ms = {name: min(ts[1:]) * 1e3 for name, ts in times.items()}
    # the op's faster form; SDPA must beat it by SDPA_MARGIN to displace it
    best_op = min((name for name in forms if forms[name] is not None), key=ms.__getitem__)
    chosen = best_op if ms[best_op] <= ms["torch SDPA"] * SDPA_MARGIN else "torch SDPA"
    measured = ", ".join(f"{name.removeprefix('the ')} {t:.1f} ms" for name, t in ms.items())
    return chosen, (
        f"{chosen} (measured: {measured} for a {n}-token chunk fresh and after {n} tokens, "
        f"layer {layer}'s heads)"
    )
