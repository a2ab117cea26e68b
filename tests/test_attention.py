"""The torch backend's two decode strategies (range views and page gathers) against a dense
reference, with shared blocks, ragged lengths, GQA and a sliding window."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.attention import kv_quant
from engine.attention.base import StepMetadata
from engine.attention.torch_backend import TorchBackend
from models.spec import ModelSpec, uniform_layers


def make_spec(
    window: int | None, heads: int = 6, kv_heads: int = 2, head_dim: int = 16
) -> ModelSpec:
    return ModelSpec(
        "LlamaForCausalLM",
        100,
        64,
        uniform_layers(1, heads, kv_heads, head_dim, 32),
        sliding_window=window,
    )


def reference(q, tables, seq_lens, cache, bs, window):
    out = []
    for i, (table, n) in enumerate(zip(tables, seq_lens)):
        pages = torch.tensor(table)
        k = cache[0][:, pages].reshape(cache.shape[1], -1, cache.shape[-1])[:, :n]
        v = cache[1][:, pages].reshape(cache.shape[1], -1, cache.shape[-1])[:, :n]
        g = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        s = (q[i][:, None, :] @ k.transpose(1, 2))[:, 0] / math.sqrt(q.shape[-1])
        if window is not None:
            s[:, : max(0, n - 1 - window + 1)] = float("-inf")
        out.append((s.softmax(-1)[:, None, :] @ v)[:, 0])
    return torch.stack(out)


F32, BF16, INT8 = torch.float32, torch.bfloat16, torch.int8
STRATEGIES = [  # (strategy, query dtype, cache dtype)
    ("cpp", F32, F32),
    ("range", F32, F32),
    ("gather", F32, F32),
    ("cpp", BF16, BF16),
    ("range", BF16, BF16),
    ("cpp", F32, INT8),
    ("cpp", BF16, INT8),
    ("gather", F32, INT8),
]


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(
    "strategy, dtype, cache_dtype, head_dim",
    # head sizes 64 and 128 take the op's register kernels (decode_attend.h), 16 its plain
    # loops; int8 rows hold a scale per 32 values
    [(*s, d) for s in STRATEGIES for d in (16, 64, 128) if s[2] != INT8 or d % 32 == 0],
)
def test_decode_strategies_match_reference(window, strategy, dtype, cache_dtype, head_dim) -> None:
    """float32 to 1e-5; bfloat16 (a bf16 cache and queries; the C++ op reads bf16 and
    accumulates in float32, the PyTorch path takes a float32 softmax) against the float32
    reference on the same bf16 values, to bf16 output rounding (2**-7 relative, 0.02 abs for
    outputs up to ~4); an int8 cache against the reference on its dequantized values (the
    step's new rows quantized as they are written)."""
    rng = random.Random(0)
    torch.manual_seed(0)
    bs, num_blocks = 4, 64
    spec = make_spec(window, head_dim=head_dim)
    cache = torch.randn(*TorchBackend.kv_cache_shape(num_blocks, bs, 2, head_dim))
    cache = kv_quant.quantize(cache) if cache_dtype == INT8 else cache.to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop(), free.pop()]  # a prefix two blocks long, used by three sequences
    tables, seq_lens = [], []
    for i in range(7):
        n = rng.randint(1, 40) + (8 if i < 3 else 0)
        own = -(-n // bs) - (2 if i < 3 else 0)
        tables.append((shared if i < 3 else []) + [free.pop() for _ in range(own)])
        seq_lens.append(n)
    # new tokens are written before attending: give the step slots at each sequence's end
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, seq_lens)])
    meta = StepMetadata(list(range(7)), [1] * 7, [n - 1 for n in seq_lens], seq_lens, tables, slots)
    backend = TorchBackend(spec, [cache], bs)
    # the compiled op must build here (CI has g++ and ninja): a silent fallback would hide a
    # performance regression
    assert backend.decode_op is not None
    if strategy != "cpp":
        backend.decode_op = None
    backend.use_range_decode = strategy == "range"
    step = backend.plan(meta)
    assert (step.cpp_decode is not None) == (strategy == "cpp")
    assert (step.range_plan is not None) == (strategy == "range")
    q = torch.randn(7, 6, head_dim).to(dtype)
    k_new, v_new = (torch.randn(7, 2, head_dim).to(dtype) for _ in range(2))
    out = step.forward(0, q, k_new, v_new)
    assert out.dtype == dtype
    stored = kv_quant.read(cache, torch.float32)  # the values the cache holds, new rows too
    expected = reference(q.float(), tables, seq_lens, stored, bs, window)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2**-7)
