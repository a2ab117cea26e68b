"""`--kv-cache-dtype int8`: rows of int8 values with a float32 scale per 32 (kv_quant.py,
kv_int8.h). 3.5x the tokens of a float32 cache in the same bytes, logits close to a float32
cache, the C++ ops and the PyTorch paths reading the same values, the measured agreement on the
banner, the host and disk tiers carrying the rows as stored (and the disk keyed by the KV dtype),
prefix hits, and what cannot hold int8 rows refused."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import DeviceFacts, kv_quant, select_backend
from engine.core.scoring import score_prompt
from models.spec import ModelSpec, uniform_layers

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(20, 90)), [300] * 3 + list(range(100, 140))]


@pytest.fixture(scope="module")
def head32(model_dirs) -> str:
    return str(model_dirs["qwen3"])  # head_dim 32: a scale per row of each head


def test_rows_round_trip_within_half_a_step() -> None:
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 30.0])[None, :, None]
    x[0, 0] = 0  # an all-zero group keeps a zero scale
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape[-1] == kv_quant.row_width(64, torch.int8) == 72
    back = kv_quant.dequantize(rows, torch.float32)
    step = x.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True) / 127
    assert ((back - x).abs().unflatten(-1, (-1, 32)) <= step / 2 + 1e-7).all()
    assert back[0, 0].eq(0).all()


def test_three_and_a_half_times_the_blocks_and_the_measured_agreement(head32) -> None:
    common = {"dtype": "float32", "block_size": 16, "kv_cache_memory": "4MiB"}
    f32 = LLM(head32, **common)
    int8 = LLM(head32, kv_cache_dtype="int8", **common)
    # 4 bytes a value against 1 + 4/32
    assert int8.engine.num_blocks >= 3.5 * f32.engine.num_blocks
    assert int8.engine.info.kv_block_bytes * 32 == f32.engine.info.kv_block_bytes * 9
    cache = int8.engine.runner.backend.kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape[-1] == 32 + 4
    line = next(ln for ln in int8.engine.info.kernel_table.splitlines() if "kv cache:" in ln)
    assert "int8 rows, a float32 scale per 32 values" in line
    assert "vs a float32 cache on" in line and "held-out positions: top-1 agreement" in line


def test_logits_close_to_a_float32_cache_and_both_paths_agree(head32) -> None:
    f32 = LLM(head32, dtype="float32", block_size=16, num_kv_blocks=64)
    int8 = LLM(head32, dtype="float32", block_size=16, num_kv_blocks=64, kv_cache_dtype="int8")
    for p in PROMPTS:  # prefill reads the int8 cache back (chunked: context from the cache)
        a, b = score_prompt(f32.engine, p), score_prompt(int8.engine, p)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.min() > 0.99, cos.min()
    cpp = int8.generate(PROMPTS, GREEDY)
    ref = f32.generate(PROMPTS, GREEDY)
    assert all(x.outputs[0].token_ids[:2] == y.outputs[0].token_ids[:2] for x, y in zip(cpp, ref))
    # the PyTorch paths (page gathers, SDPA) dequantize the same rows into the same arithmetic
    backend = int8.engine.runner.backend
    assert backend.decode_op is not None and backend.prefill_op is not None
    backend.decode_op = backend.rope_decode_op = backend.rope_write_op = None
    backend.prefill_op = None
    torch_path = int8.generate(PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in torch_path] == [r.outputs[0].token_ids for r in cpp]
    assert int8.engine.kv.pool.num_free_blocks == int8.engine.num_blocks


def sessions(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(length)] for _ in range(n)]


def test_prefix_hits_and_the_host_tier_carry_int8_rows(head32) -> None:
    prompts = sessions(6, 60)
    kw = {"dtype": "float32", "block_size": 8, "kv_cache_dtype": "int8"}
    big = LLM(head32, num_kv_blocks=256, **kw)
    expected = [r.outputs[0].token_ids for r in big.generate(prompts, GREEDY)]
    hit = big.generate([prompts[0]], GREEDY)[0]
    assert hit.num_cached_tokens >= 56 and hit.outputs[0].token_ids == expected[0]
    small = LLM(head32, num_kv_blocks=24, host_bytes="64MiB", **kw)
    first = small.generate(prompts, GREEDY)  # 6 sessions x 8 blocks: far more than 24
    assert small.engine.host is not None and small.engine.host.saved_blocks > 0
    again = small.generate([prompts[0]], GREEDY)[0]
    assert small.engine.kv.hits_by_source["host"] >= 48
    assert again.outputs[0].token_ids == expected[0]
    assert [r.outputs[0].token_ids for r in first] == expected


def test_the_disk_tier_is_keyed_by_the_kv_dtype(head32, tmp_path: Path) -> None:
    prompt = sessions(1, 100, seed=9)[0]
    kw = {
        "dtype": "float32",
        "num_kv_blocks": 64,
        "block_size": 8,
        "host_bytes": "1MiB",
        "disk_path": str(tmp_path / "kv"),
    }
    first = LLM(head32, **kw)  # a float32 cache's blocks on disk
    first.generate([prompt], GREEDY)
    first.engine.shutdown()
    int8 = LLM(head32, kv_cache_dtype="int8", **kw)
    cold = int8.generate([prompt], GREEDY)[0]
    assert int8.engine.kv.hits_by_source["disk"] == 0  # float32 blocks are not int8 rows
    int8.engine.shutdown()
    again = LLM(head32, kv_cache_dtype="int8", **kw)
    warm = again.generate([prompt], GREEDY)[0]
    assert again.engine.kv.hits_by_source["disk"] > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def test_what_cannot_hold_int8_rows_is_refused(llama_dir) -> None:
    with pytest.raises(ValueError, match="head_dim 16 is not a multiple of 32"):
        LLM(str(llama_dir), kv_cache_dtype="int8", dtype="float32")
    with pytest.raises(ValueError, match="no kernel here reads fp8"):
        LLM(str(llama_dir), kv_cache_dtype="fp8", dtype="float32")
    spec = ModelSpec("LlamaForCausalLM", 100, 256, uniform_layers(2, 8, 2, 64, 512))
    sm90 = DeviceFacts("cuda", "H100", (9, 0), True, frozenset({"flashinfer"}))
    assert select_backend(spec, sm90, torch.bfloat16, 16).backend.name == "flashinfer"
    choice = select_backend(spec, sm90, torch.bfloat16, 16, kv_dtype=torch.int8)
    assert choice.backend.name == "torch"  # the GPU kernels read float pages only
    assert "flashinfer / int8 KV: its kernels read float16/bfloat16 pages" in choice.table
    with pytest.raises(ValueError, match="int8 KV"):
        select_backend(spec, sm90, torch.bfloat16, 16, forced="flashinfer", kv_dtype=torch.int8)
