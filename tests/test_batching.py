"""Continuous batching must not change results: alone, batched, chunked, or preempted."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


@pytest.fixture(scope="module")
def greedy_alone(llama_dir) -> tuple[list[list[int]], list[list[int]]]:
    prompts = mixed_prompts(16)
    llm = LLM(str(llama_dir), num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    return prompts, alone


def run(llama_dir, prompts, params, **kw):
    llm = LLM(str(llama_dir), **kw)
    outs = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    return llm, outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_batch_of_16_matches_alone(llama_dir, greedy_alone) -> None:
    prompts, alone = greedy_alone
    _, outs = run(llama_dir, prompts, GREEDY, num_kv_blocks=256)
    assert outs == alone


def test_small_chunked_prefill_matches_alone(llama_dir, greedy_alone) -> None:
    prompts, alone = greedy_alone
    llm, outs = run(llama_dir, prompts, GREEDY, num_kv_blocks=256, max_num_batched_tokens=8)
    assert outs == alone


def test_preemption_matches_alone(llama_dir, greedy_alone) -> None:
    prompts, alone = greedy_alone
    # 16 blocks of 4 tokens: far less than 16 requests of up to 113 tokens need at once.
    llm, outs = run(llama_dir, prompts, GREEDY, num_kv_blocks=32, block_size=4)
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs == alone
    assert llm.engine.kv.pool.num_free_blocks == 32


def test_prefix_cache_on_off_identical(llama_dir, greedy_alone) -> None:
    prompts, alone = greedy_alone
    shared = prompts[1][:40]
    workload = [shared + p[:20] for p in prompts] + [shared, shared[:17], shared[:3]] + prompts
    llm_on, on = run(llama_dir, workload, GREEDY, num_kv_blocks=256, block_size=4)
    assert llm_on.engine.kv.prefix_hits >= 15 * 40
    _, off = run(
        llama_dir, workload, GREEDY, num_kv_blocks=256, block_size=4, enable_prefix_caching=False
    )
    assert on == off
    assert on[-16:] == alone


def test_seeded_sampling_reproducible_across_batches(llama_dir) -> None:
    prompts = mixed_prompts(6, seed=1)
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True
    )
    llm = LLM(str(llama_dir), num_kv_blocks=256)
    alone = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    again = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts, [params] + [unseeded] * 5)[0].outputs[0].token_ids
    chunked = LLM(str(llama_dir), num_kv_blocks=256, max_num_batched_tokens=5)
    assert alone == again == batch == chunked.generate([prompts[0]], params)[0].outputs[0].token_ids
    other = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True
    )
    assert llm.generate([prompts[0]], other)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize(
    ("scheduling", "short_arrives"),
    [("deadline", "with_long"), ("deadline", "after_long_due"), ("fcfs", "with_long")],
)
def test_a_prefix_hit_goes_before_long_prefill_chunks(llama_dir, scheduling, short_arrives) -> None:
    """Under deadline ordering, a newcomer whose prompt is cached but for a short suffix gets
    its first token while another request's long prompt is still being prefilled in chunks;
    once the long prompt is past its own deadline it goes first (nothing starves); under fcfs
    the newcomer waits its turn behind those chunks. Outputs are unchanged. Arrivals are
    stamped, not timed: on the tiny model a deadline is milliseconds away, less than a loaded
    machine's step."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 500, (96,), generator=g).tolist()
    long_prompt = torch.randint(3, 500, (600,), generator=g).tolist()
    short_prompt = shared + [300, 301, 302]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm = LLM(
        str(llama_dir),
        num_kv_blocks=128,
        block_size=16,
        max_num_batched_tokens=64,
        scheduling=scheduling,
    )
    llm.generate([shared + [200]], params)  # the shared prefix enters the cache
    engine = llm.engine
    long = engine.add_request("long", long_prompt, params)
    engine.step()  # the long prompt's first chunk
    arrival = long.arrival_time if short_arrives == "with_long" else long.deadline + 1e-3
    short = engine.add_request("short", short_prompt, params, arrival_time=arrival)
    assert short.prefill_estimate == 3 and short.deadline > arrival
    first_token: dict[str, int] = {}
    outputs: dict[str, list[int]] = {"long": [], "short": []}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.new_token_ids:
                first_token.setdefault(out.request_id, steps)
    if scheduling == "deadline" and short_arrives == "with_long":
        assert first_token["short"] <= 2 < first_token["long"], first_token
    else:
        assert first_token["short"] >= first_token["long"], first_token  # behind its chunks
    alone = LLM(str(llama_dir), num_kv_blocks=128, block_size=16)
    for rid, prompt in (("long", long_prompt), ("short", short_prompt)):
        assert outputs[rid] == alone.generate([prompt], params)[0].outputs[0].token_ids
