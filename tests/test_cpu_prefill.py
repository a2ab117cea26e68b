"""The C++ paged prefill attention (kernels/cpu_prefill.cpp) against a float64
reference, and the torch backend's prefill through it against the same step on SDPA: chunks with
and without earlier context, shuffled pages, GQA, a sliding window, head sizes that take each of
the op's vector blockings, float32, a bf16 cache under float32 queries, bf16 throughout
(bf16 dot products where the CPU has them), and an int8 cache (rows with their scales, read back
through the same arithmetic) under either."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.attention import cpu_prefill, kv_quant
from engine.attention.base import StepMetadata
from engine.attention.torch_backend import TorchBackend
from models.spec import ModelSpec, uniform_layers

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

DTYPES = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8),
]


def cast(cache: torch.Tensor, cdtype: torch.dtype) -> torch.Tensor:
    """A float cache in the cache dtype (int8: rows with their scales)."""
    return kv_quant.quantize(cache) if cdtype == torch.int8 else cache.to(cdtype)


def ops():
    loaded = cpu_prefill.load()
    # the op must build here (CI has g++, ninja and AVX2): a silent fallback would hide a
    # performance regression
    assert loaded is not None
    return loaded


def paged(ctx: int, n: int, heads: int, kv_heads: int, dim: int, bs: int, dtype, cdtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    npages = -(-(ctx + n) // bs)
    cache = cast(torch.randn(2, kv_heads, npages + 3, bs, dim, generator=g), cdtype)
    pages = torch.randperm(npages + 3, generator=g)[:npages].to(torch.int32)
    # q as the model hands it over: a view of a wider row (q and k heads side by side)
    qk = torch.randn(n, heads + kv_heads, dim, generator=g).to(dtype)
    return qk[:, :heads], cache, pages


def reference(q, cache, pages, ctx, window, scale):
    n, _, dim = q.shape
    seq = ctx + n
    kv_heads = cache.shape[1]
    cache = kv_quant.read(cache, torch.float64)
    k = cache[0][:, pages.long()].reshape(kv_heads, -1, dim)[:, :seq]
    v = cache[1][:, pages.long()].reshape(kv_heads, -1, dim)[:, :seq]
    q_pos, k_pos = torch.arange(ctx, seq)[:, None], torch.arange(seq)[None]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    o = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None],
        k[None],
        v[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


CASES = [  # ctx, n, heads, kv_heads, dim, bs, window
    (0, 1, 6, 2, 64, 16, 0),
    (0, 37, 9, 3, 64, 16, 0),  # a partial query block, keys ending mid-block
    (100, 75, 4, 2, 128, 16, 0),  # earlier context (a prefix hit, a second chunk)
    (0, 300, 4, 4, 64, 32, 50),  # a window smaller than the chunk: early blocks skipped
    (513, 130, 6, 2, 96, 16, 0),  # 96: the op's two-vector blocking
    (70, 200, 4, 1, 32, 16, 129),  # window past the context's start
    (3, 65, 2, 1, 16, 4, 0),
]


@pytest.mark.parametrize(
    "ctx, n, heads, kv_heads, dim, bs, window, dtype, cdtype",
    # int8 rows hold a scale per 32 values
    [(*c, *d) for c in CASES for d in DTYPES if d[1] != torch.int8 or c[4] % 32 == 0],
)
def test_op_matches_reference(ctx, n, heads, kv_heads, dim, bs, window, dtype, cdtype) -> None:
    """float32 arithmetic: to 1e-5 of float64. bf16 queries (on a bf16 cache, or an int8 one
    whose values the op rounds to bf16): to bf16 output rounding (2**-7 relative of outputs up
    to ~2, probabilities rounded to bf16 before P.V)."""
    op = ops()
    if dim % op.simd_width():
        pytest.skip(f"head size {dim} is not a multiple of this build's width")
    q, cache, pages = paged(ctx, n, heads, kv_heads, dim, bs, dtype, cdtype)
    scale = 1 / math.sqrt(dim)
    out = torch.full_like(q.contiguous(), float("nan"))
    op.paged_prefill(q, out, cache[0], cache[1], pages, ctx, scale, window)
    expected = reference(q, cache, pages, ctx, window, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)


@pytest.mark.parametrize(
    "ctx, n, heads, kv_heads, dim, bs, window, cdtype",
    [
        (*c, cd)
        for c in CASES
        for cd in (torch.bfloat16, torch.int8)
        if cd != torch.int8 or c[4] % 32 == 0
    ],  # int8 rows hold a scale per 32 values
)
def test_tile_gemm_op_matches_reference(ctx, n, heads, kv_heads, dim, bs, window, cdtype) -> None:
    """paged_prefill_tiles: bf16 queries with Q K^T and P V as brgemm tile GEMMs (AMX where the
    CPU has it; this machine's AVX-512 ukernel or fallback otherwise: only its correctness is
    checked here) on the paged cache, to the same bf16 tolerance as the dot-product path, and
    to a few bf16 roundings of that path (the same products, summed in another order)."""
    op = ops()  # built without AVX512-BF16 (tiles() False), the op takes its dot-product form
    if dim % op.simd_width():
        pytest.skip(f"head size {dim} is not a multiple of this build's width")
    q, cache, pages = paged(ctx, n, heads, kv_heads, dim, bs, torch.bfloat16, cdtype)
    scale = 1 / math.sqrt(dim)
    tiled = torch.full_like(q.contiguous(), float("nan"))
    op.paged_prefill_tiles(q, tiled, cache[0], cache[1], pages, ctx, scale, window)
    dotted = torch.full_like(q.contiguous(), float("nan"))
    op.paged_prefill(q, dotted, cache[0], cache[1], pages, ctx, scale, window)
    expected = reference(q, cache, pages, ctx, window, scale)
    torch.testing.assert_close(tiled.double(), expected, atol=2e-2, rtol=2**-7)
    torch.testing.assert_close(tiled.float(), dotted.float(), atol=2e-2, rtol=2**-6)


def test_op_refuses_what_it_cannot_read() -> None:
    op = ops()
    q, cache, pages = paged(0, 8, 2, 1, 16, 4, torch.float32, torch.float32)
    out = torch.empty_like(q.contiguous())
    with pytest.raises(RuntimeError, match="pages cover"):
        op.paged_prefill(q, out, cache[0], cache[1], pages[:1], 0, 0.25, 0)
    with pytest.raises(RuntimeError):  # a float32 cache under bf16 queries
        op.paged_prefill(q.bfloat16(), out.bfloat16(), cache[0], cache[1], pages, 0, 0.25, 0)


@pytest.mark.parametrize("dtype, cdtype", DTYPES)
@pytest.mark.parametrize("window", [None, 24])
def test_backend_prefill_op_matches_sdpa(window, dtype, cdtype) -> None:
    """One step of three prefill chunks (fresh, after a context, one row past a shared prefix)
    and a decode row: the op's output equals the SDPA path's on the same cache. A bf16 cache
    under float32 queries to bf16 rounding: SDPA attends a fresh chunk's unrounded K/V, the op
    the cache's rounded ones (as decode and a prefix hit do); an int8 cache the same way."""
    bs, heads, kv_heads, dim = 4, 6, 2, 32 if cdtype == torch.int8 else 16
    spec = ModelSpec(
        "LlamaForCausalLM",
        100,
        96,
        uniform_layers(1, heads, kv_heads, dim, 32),
        sliding_window=window,
    )
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(*TorchBackend.kv_cache_shape(64, bs, kv_heads, dim), generator=g)
    cache = cast(cache, cdtype)
    perm = torch.randperm(64, generator=g).tolist()
    shared = perm[:5]
    plan = [(0, 29), (17, 40), (20, 1), (33, 1)]  # (context, query tokens) per sequence
    tables, start, slots = [], 0, []
    for i, (ctx, n) in enumerate(plan):
        need = -(-(ctx + n) // bs)
        own = [perm.pop() for _ in range(need - (5 if i in (1, 2) else 0))]
        table = (shared if i in (1, 2) else []) + own
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + n)]
        start += n
    meta = StepMetadata(
        [0, 29, 69, 70],
        [n for _, n in plan],
        [c for c, _ in plan],
        [c + n for c, n in plan],
        tables,
        torch.tensor(slots),
    )
    rows = sum(n for _, n in plan)
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    k = torch.randn(rows, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(rows, kv_heads, dim, generator=g).to(dtype)
    backend = TorchBackend(spec, [cache.clone()], bs)
    assert backend.prefill_op is not None
    with_op = backend.plan(meta).forward(0, q, k, v)
    backend = TorchBackend(spec, [cache.clone()], bs)
    backend.prefill_op = None
    with_sdpa = backend.plan(meta).forward(0, q, k, v)
    if cdtype == torch.float32:
        torch.testing.assert_close(with_op, with_sdpa, atol=1e-5, rtol=1e-4)
    elif cdtype == torch.int8:  # SDPA's fresh chunk reads unrounded K/V: a quantization step
        torch.testing.assert_close(with_op.float(), with_sdpa.float(), atol=6e-2, rtol=2**-5)
    else:
        torch.testing.assert_close(with_op.float(), with_sdpa.float(), atol=3e-2, rtol=2**-6)


@pytest.mark.parametrize("dtype, cdtype", DTYPES)
def test_rope_write_matches_rotary_then_write(dtype, cdtype) -> None:
    """The fused rotary + KV write (any step's rows) against `apply_rope` and the backend's own
    indexed write: q rotated as apply_rope rotates it, the cache holding the same k and v (an
    int8 cache: the same values to within a rounding step, C++ and PyTorch rounding alike)."""
    from models.layers import apply_rope

    bs, heads, kv_heads, n = 4, 6, 2, 23
    dim = 32 if cdtype == torch.int8 else 16
    spec = ModelSpec("LlamaForCausalLM", 100, 96, uniform_layers(1, heads, kv_heads, dim, 32))
    g = torch.Generator().manual_seed(2)
    cache = cast(torch.zeros(*TorchBackend.kv_cache_shape(16, bs, kv_heads, dim)), cdtype)
    table = torch.randperm(16, generator=g)[:6].tolist()
    meta = StepMetadata(
        [0], [n], [0], [n], [table], torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    )
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(n, dim // 2, generator=g) * 6
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # as the model passes them
    fused = TorchBackend(spec, [cache.clone()], bs)
    q = fused.plan(meta).rope_write(0, qkv, cos, sin, heads)
    assert q is not None
    plain = TorchBackend(spec, [cache.clone()], bs)
    step = plain.plan(meta)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(n, -1, dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    step.forward(0, qk[:, :heads], qk[:, heads:], v)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-7}
    torch.testing.assert_close(q, qk[:, :heads], **tol)
    if cdtype == torch.int8:
        fused_kv, plain_kv = (kv_quant.read(b.kv_caches[0], torch.float32) for b in (fused, plain))
        step = plain_kv.abs().amax() / 127  # the coarsest rounding step of any group
        torch.testing.assert_close(fused_kv, plain_kv, atol=float(step), rtol=0)
        if dtype == torch.float32:  # bf16: the plain path rounds k to bf16 before int8
            assert (fused_kv - plain_kv).abs().gt(1e-6).float().mean() < 0.01  # ties, not drift
        return
    torch.testing.assert_close(fused.kv_caches[0], plain.kv_caches[0], **tol)
