"""Prefix caching: correctness with full hits, tenant salts, multi-turn reuse, LRU eviction."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

GREEDY_LP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=64, block_size=16)


def test_fully_cached_prompt_recomputes_last_token(llm: LLM, llama_dir) -> None:
    prompt = list(range(20, 68))  # exactly three blocks
    first = llm.generate([prompt], GREEDY_LP)[0]
    second = llm.generate([prompt], GREEDY_LP)[0]
    assert first.num_cached_tokens == 0
    # two whole blocks plus 15 tokens of the third copied from the cached block: only the last
    # token is recomputed
    assert second.num_cached_tokens == 47
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    for a, b in zip(first.outputs[0].logprobs, second.outputs[0].logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-5
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    nocache = LLM(str(llama_dir), num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    ref = nocache.generate([prompt], GREEDY_LP)[0]
    assert ref.num_cached_tokens == 0
    for a, b in zip(ref.outputs[0].logprobs, second.outputs[0].logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-5


def test_cache_salt_isolates_tenants(llm: LLM) -> None:
    prompt = list(range(100, 160))

    def cached(salt: str | None) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=2, cache_salt=salt)
        return llm.generate([prompt], params)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") == 48
    assert cached("tenant-b") == 48
    assert cached(None) == 48


def test_generated_tokens_are_cached_for_the_next_turn(llm: LLM) -> None:
    prompt = list(range(200, 230))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    turn1 = llm.generate([prompt], params)[0]
    history = prompt + turn1.outputs[0].token_ids  # 70 tokens: 4 full blocks
    turn2 = llm.generate([history + [7, 8, 9]], params)[0]
    assert turn2.num_cached_tokens == 64


def test_lru_eviction_keeps_recent_and_referenced_blocks(llama_dir) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=10, block_size=4)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    a, b, c = list(range(10, 26)), list(range(30, 46)), list(range(50, 74))
    llm.generate([a], one)  # a's 4 blocks cached, then b's
    llm.generate([b], one)
    pool = llm.engine.kv.pool
    assert len(pool.cached) == 8
    llm.generate([c], one)  # needs 7 blocks: 2 free + 5 evicted, a's first (its tail first)
    assert llm.generate([b], one)[0].num_cached_tokens == 15  # b intact (all but its last token)
    assert llm.generate([a], one)[0].num_cached_tokens == 0  # a's head block went last, gone
    assert pool.num_evictions >= 5


def test_referenced_blocks_are_never_evicted(llama_dir) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=12, block_size=4, max_num_batched_tokens=4)
    engine = llm.engine
    shared = list(range(10, 22))
    engine.add_request("long", shared + [1, 2], SamplingParams(temperature=0.0, max_tokens=20))
    while engine.scheduler.requests["long"].num_computed_tokens < 14:
        engine.step()
    held = {b.block_id for b in engine.kv.block_tables["long"]}
    engine.add_request("other", list(range(40, 60)), SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
        table = engine.kv.block_tables.get("long")
        if table is not None:
            assert held <= {b.block_id for b in table}
            assert all(b.ref_cnt >= 1 for b in table)


@pytest.mark.slow
def test_turn_two_of_a_chat_on_smollm2(smollm2_path) -> None:
    # float32 explicitly: the same greedy answer on every CPU (`auto` may pick bf16)
    llm = LLM(smollm2_path, num_kv_blocks=64, block_size=16, dtype="float32")
    tok = llm.tokenizer
    assert tok is not None
    bs = llm.engine.block_size
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    turn1 = llm.chat(msgs, params)[0]
    answer = turn1.outputs[0]
    msgs2 = msgs + [
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "And of Germany?"},
    ]
    ids2 = tok.encode(tok.apply_chat_template(msgs2), add_special_tokens=False)
    history = turn1.prompt_token_ids + answer.token_ids
    same = next((i for i, (x, y) in enumerate(zip(history, ids2)) if x != y), len(history))
    assert same >= len(turn1.prompt_token_ids)  # the template did not rewrite turn 1
    turn2 = llm.chat(msgs2, params)[0]
    assert turn2.num_cached_tokens >= (min(same, len(ids2) - 1) // bs) * bs
    assert turn2.num_cached_tokens >= bs
    assert "Berlin" in turn2.outputs[0].text


def test_prompt_diverging_mid_block_reuses_the_matching_part(llm: LLM, llama_dir) -> None:
    base = list(range(300, 348))  # three 16-token blocks, all cached after the first run
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    llm.generate([base], params)
    diverging = base[:40] + [7, 8, 9, 10, 11]  # block 2 matches for 8 tokens, then differs
    hit = llm.generate([diverging], params)[0]
    assert hit.num_cached_tokens == 40
    cold = LLM(str(llama_dir), num_kv_blocks=64, block_size=16, enable_prefix_caching=False)
    ref = cold.generate([diverging], params)[0]
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    for a, b in zip(hit.outputs[0].logprobs, ref.outputs[0].logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-5
    salted = SamplingParams(temperature=0.0, max_tokens=2, cache_salt="other")
    assert llm.generate([diverging], salted)[0].num_cached_tokens == 0
