"""`--kv-cache-dtype bfloat16` under a float32 model (CPU): twice the tokens in the same pool
bytes, logits close to a float32 cache, the C++ decode op and the PyTorch paths agreeing, and
what is not available refused at startup."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(20, 90)), [300] * 3 + list(range(100, 140))]


def engines(llama_dir, **kw) -> tuple[LLM, LLM]:
    common = {"dtype": "float32", "block_size": 16, **kw}
    return LLM(str(llama_dir), **common), LLM(str(llama_dir), kv_cache_dtype="bfloat16", **common)


def test_twice_the_blocks_in_the_same_bytes(llama_dir) -> None:
    f32, bf16 = engines(llama_dir, kv_cache_memory="4MiB")
    assert bf16.engine.num_blocks == 2 * f32.engine.num_blocks
    assert bf16.engine.info.kv_block_bytes * 2 == f32.engine.info.kv_block_bytes
    assert "kv cache: bfloat16 under float32" in bf16.engine.info.kernel_table
    assert "kv cache: float32 (the serving dtype)" in f32.engine.info.kernel_table
    assert bf16.engine.runner.backend.kv_caches[0].dtype == torch.bfloat16


def test_logits_and_decoding_close_to_a_float32_cache(llama_dir) -> None:
    f32, bf16 = engines(llama_dir, num_kv_blocks=64)
    for p in PROMPTS:  # prefill reads the bf16 cache back (chunked: context from the cache)
        a, b = score_prompt(f32.engine, p), score_prompt(bf16.engine, p)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.min() > 0.999, cos.min()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    cpp = bf16.generate(PROMPTS, params)
    ref = f32.generate(PROMPTS, params)
    for x, y in zip(cpp, ref, strict=True):
        lx = [e.logprob for e in x.outputs[0].logprobs]
        ly = [e.logprob for e in y.outputs[0].logprobs]
        # greedy on a tiny random model can flip between near-ties; until it does, the chosen
        # tokens' logprobs agree closely
        same = next(
            (
                i
                for i, (s, t) in enumerate(zip(x.outputs[0].token_ids, y.outputs[0].token_ids))
                if s != t
            ),
            12,
        )
        assert same >= 4 and all(abs(s - t) < 0.1 for s, t in zip(lx[:same], ly[:same]))
    # the PyTorch decode paths read the same cache into the same float32 arithmetic
    backend = bf16.engine.runner.backend
    assert backend.decode_op is not None
    backend.decode_op = None
    torch_path = bf16.generate(PROMPTS, params)
    for x, y in zip(cpp, torch_path, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    assert bf16.engine.kv.pool.num_free_blocks == bf16.engine.num_blocks


@pytest.mark.parametrize(
    "kv,dtype,match",
    [
        ("fp8", "float32", "no kernel here reads fp8"),
        ("float32", "bfloat16", "narrower"),
    ],
)
def test_what_is_not_available_is_refused(llama_dir, kv, dtype, match) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), kv_cache_dtype=kv, dtype=dtype, allow_slow_dtype=True)


def test_same_as_the_model_is_auto(llama_dir) -> None:
    llm = LLM(str(llama_dir), kv_cache_dtype="float32", dtype="float32", num_kv_blocks=16)
    assert llm.engine.runner.backend.kv_caches[0].dtype == torch.float32
