"""Drafts without a head (engine/spec/drafting.py): suffix drafts from the request's own tokens and
recent outputs, grammar drafts from a constraint's forced tokens. Lossless: greedy output is
identical with them on and off, and a deterministic draft's verification draws every token
from the target's own distribution."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.core.sampling_params import GrammarSpec
from engine.spec.suffix_index import RecentOutputs, SuffixIndex
from engine.spec.verify import verify
from tests.test_constrained_decoding import PROMPTS, SCHEMA
from tests.test_speculative import prompts

PIN_K = {"spec_max_verify_rows": 1 << 16, "spec_cost_model": False}


def drafting_llm(llama_dir, k: int, method: str = "auto", **extra) -> LLM:
    """The tiny llama drafting up to `k` tokens a step by `method`, on 256 blocks of 4, with k
    pinned (PIN_K): no verify-row cap or measured step cost cuts it."""
    options = {"num_kv_blocks": 256, "block_size": 4, **PIN_K, **extra}
    return LLM(str(llama_dir), num_speculative_tokens=k, speculative_method=method, **options)


def test_suffix_index_continues_the_latest_longest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    index = SuffixIndex(tokens)
    assert index.match(4) == ([5, 7, 1, 2], 3)  # [1 2 3]'s latest earlier occurrence
    tokens += [5, 7, 8]  # grows in place, like a request's all_token_ids
    assert index.match(2) == ([], 0)  # [7 8] and [8] never occurred before
    tokens.append(1)
    drafts, n = index.match(3)
    assert n == 0 or drafts  # 1-grams are not indexed: a lone token is too weak a guess
    assert SuffixIndex([4, 4]).match(3) == ([], 0)


def test_recent_outputs_are_bounded_and_forget_the_oldest() -> None:
    recent = RecentOutputs(max_tokens=10)
    recent.add([1, 2, 3, 4, 5, 6])
    assert recent.match([9, 1, 2], 3) == ([3, 4, 5], 2)
    recent.add([7, 8, 9, 10, 11, 12])  # 12 tokens > 10: the first output goes
    assert recent.num_tokens == 6
    assert recent.match([9, 1, 2], 3) == ([], 0)
    assert recent.match([7, 8], 2) == ([9, 10], 2)
    assert all(oid in recent.by_id for oid, _ in recent.table.values())


def request_with_draft(logits_rows: int, draft: int, seed: int) -> Request:
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed)
    r = Request(f"r{seed}", [1, 2, 3], params, frozenset(), 64)
    r.spec_token_ids = [draft] * (logits_rows - 1)
    return r


def test_a_deterministic_draft_keeps_the_targets_distribution() -> None:
    """Draft token 2 (one-hot q) against p: the first emitted token must follow p exactly
    (kept with probability p(2), else drawn from p without 2), and the token after an
    accepted draft follows the second row's p. A rule that kept every draft fails at once."""
    logits = torch.tensor([[1.0, 0.5, 2.0, 0.0, -1.0], [0.0, 1.5, 0.2, 0.8, 0.3]])
    p = logits.softmax(-1)
    n = 6000
    first, second = Counter(), Counter()
    for seed in range(n):
        tokens = verify(logits, [request_with_draft(2, 2, seed)])[0].token_ids
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    for counts, row in ((first, p[0]), (second, p[1])):
        observed = torch.tensor([counts[t] for t in range(5)], dtype=torch.float64)
        expected = row.double() * observed.sum()
        stat = ((observed - expected) ** 2 / expected).sum()
        fit = float(torch.special.gammaincc(torch.tensor(2.0, dtype=torch.float64), stat / 2))
        assert fit > 0.001, (counts, row)  # Pearson's goodness of fit, 4 degrees of freedom
    assert abs(sum(second.values()) / n - float(p[0, 2])) < 0.03  # kept with probability p(2)


@pytest.fixture(scope="module")
def plain(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=256, block_size=4)


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_greedy_identical_with_suffix_drafts(llama_dir, plain, method) -> None:
    """Token for token the plain engine's output, with suffix drafts from the prompt (each
    repeats half of itself) and, the second time the prompts are sent, from the first run's
    outputs: then nearly every draft is kept (chunked prefill on)."""
    ps = [p + p[: len(p) // 2] for p in prompts(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [r.outputs[0].token_ids for r in plain.generate(ps, greedy)]
    llm = drafting_llm(llama_dir, 5, method, max_num_batched_tokens=24)
    for _ in range(2):
        got = [r.outputs[0].token_ids for r in llm.generate(ps, greedy)]
        assert got == want
    suffix = llm.engine.drafter.stats["suffix"]
    assert suffix.num_accepted_tokens > 150 and suffix.mean_acceptance_length > 3
    assert llm.engine.kv.pool.num_free_blocks == 256
    snap = llm.engine.snapshot().spec
    assert snap is not None and snap.by_source["suffix"][1] == suffix.num_accepted_tokens


def test_grammar_drafts_are_lossless_and_taken(llama_dir, plain) -> None:
    greedy = SamplingParams(
        temperature=0.0, max_tokens=80, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))
    )
    want = [r.outputs[0].token_ids for r in plain.generate(PROMPTS, [greedy] * 3)]
    llm = drafting_llm(llama_dir, 6, "grammar")
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, [greedy] * 3)]
    assert got == want
    stats = llm.engine.drafter.stats["grammar"]
    # the schema's keys and punctuation are forced: most grammar drafts are kept
    assert stats.num_accepted_tokens > 10
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    assert llm.engine.kv.pool.num_free_blocks == 256


def test_recent_outputs_are_kept_per_cache_salt() -> None:
    """A tenant's suffix drafts never come from another tenant's outputs (a draft that is kept
    makes a request faster: a timing channel, like a shared prefix cache's)."""
    from engine.spec.drafting import Drafter

    drafter = Drafter(("suffix",), 4, 64)

    def request(salt: str, prompt: list[int], output: list[int]) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=32, cache_salt=salt)
        r = Request(f"{salt}{len(output)}", prompt, params, frozenset(), 256)
        for t in output:
            r.append_token(t)
        return r

    drafter.finished(request("a", [1, 2], [50, 60, 70, 80, 90, 100]))
    for salt, want in (("a", [80, 90, 100]), ("b", [])):
        r = request(salt, [3, 4], [50, 60, 70])
        drafter.propose([r])
        assert r.spec_token_ids == want, salt


def test_a_seeded_sampled_request_depends_on_its_seed_alone(llama_dir, plain) -> None:
    """Suffix drafts come partly from other requests' outputs; a seeded sampled request is not
    drafted for, so it gives the plain engine's tokens whatever ran before it."""
    llm = drafting_llm(llama_dir, 5)
    ps = prompts(4)
    seeded = [SamplingParams(temperature=0.9, max_tokens=24, seed=i) for i in range(4)]
    want = [r.outputs[0].token_ids for r in plain.generate(ps, seeded)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(ps, greedy)  # recent outputs now hold these prompts' continuations
    assert [r.outputs[0].token_ids for r in llm.generate(ps, seeded)] == want


def test_step_costs_are_measured_inside_a_small_pool(llama_dir) -> None:
    """The startup measurement writes scratch KV: with 32 blocks of 4 tokens (less than its
    usual 128-token context) it must stay inside the pool, and the engine then serves."""
    llm = LLM(str(llama_dir), num_kv_blocks=32, block_size=4, num_speculative_tokens=4)
    cost = llm.engine.drafter.cost
    assert cost is not None and all(-(-(64 + r) // 4) <= 32 for r in cost.rows)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
