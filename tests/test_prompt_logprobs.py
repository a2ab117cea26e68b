"""Prompt logprobs are computed in the request's own scheduled prefill (SamplingParams
.prompt_logprobs), not by a side pass: chunked, batched with other requests, next to a warm
prefix cache, they equal a full-sequence scoring of the prompt."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt

PROMPTS = [[5, 17, 99, 3, 44, 8, 120, 7, 61, 33, 11, 250, 18], [40, 41], [7], list(range(3, 40))]
TOP = 3


@pytest.fixture(scope="module")
def chunked(llama_dir) -> LLM:
    """Small blocks and an 8-token step budget: every prompt above 8 tokens is prefilled in
    chunks over several steps."""
    return LLM(str(llama_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)


def reference(llm: LLM, prompt: list[int]) -> list[tuple[float, list[int]]]:
    """(logprob of token i, the top alternatives' ids) for i = 1.., from one whole scoring."""
    lp = score_prompt(llm.engine, prompt)[:-1].log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    tops = lp.topk(TOP, dim=-1).indices.tolist()
    return list(zip(chosen, tops, strict=True))


def check(entries, want) -> None:
    assert entries[0] is None  # nothing predicts the first token
    assert len(entries) == len(want) + 1
    for got, (logprob, top_ids) in zip(entries[1:], want, strict=True):
        assert got.logprob == pytest.approx(logprob, abs=1e-4)
        assert [i for i, _ in got.top] == top_ids


def test_chunked_prefills_score_each_prompt_like_a_whole_pass(chunked) -> None:
    want = [reference(chunked, p) for p in PROMPTS]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP, ignore_eos=True)
    # in one batch with requests that do not score: those are as they are alone
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    alone = chunked.generate(PROMPTS[:2], [plain] * 2)
    outs = chunked.generate(PROMPTS + PROMPTS[:2], [params] * len(PROMPTS) + [plain] * 2)
    for out, w in zip(outs, want):
        check(out.outputs[0].prompt_logprobs, w)
    for a, b in zip(alone, outs[len(PROMPTS) :]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].prompt_logprobs is None
    assert chunked.engine.kv.pool.num_free_blocks == chunked.engine.num_blocks


def test_a_scored_prompt_takes_no_prefix_hit_and_stays_exact(chunked) -> None:
    prompt = PROMPTS[3]
    chunked.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    again = chunked.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.num_cached_tokens > 0  # the prompt's blocks are in the cache
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored = chunked.generate([prompt], params)[0]
    assert scored.num_cached_tokens == 0  # it computed every position itself
    entries = scored.outputs[0].prompt_logprobs
    assert entries[0] is None and all(e.top == [] for e in entries[1:])
    want = [lp for lp, _ in reference(chunked, prompt)]
    assert [e.logprob for e in entries[1:]] == pytest.approx(want, abs=1e-4)
