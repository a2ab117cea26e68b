"""The scheduler and the KV cache manager without a model: a fake runner stands in for the
forward and the sampler, and hypothesis drives add / step / abort sequences (with pools small
enough to force preemption), checking after every operation the invariants the modules'
docstrings state."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.batch import SchedulerOutput
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.sampled import SamplerOutput
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.step_budget import StepBudget, StepCosts
from engine.kv.manager import KVCacheManager
from engine.runner.runner_output import RunnerOutput

EOS = 0
VOCAB = 50


def make(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 4,
    budget: int | StepBudget = 16,
    by_deadline: bool = False,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    if isinstance(budget, int):
        budget = StepBudget(budget)
    return Scheduler(kv, max_num_seqs, budget, by_deadline=by_deadline)


# a step of n tokens costs 2 + n ms: held to 12 tokens, streamed decode rows to 2x their step
CAPPED = StepBudget(
    16, StepCosts((1, 16), (0.003, 0.018)), target_rows=12, max_itl_factor=2.0, min_prefill_tokens=2
)


def request(
    rid: str, prompt: list[int], max_tokens: int, ignore_eos: bool = True, streamed: bool = False
) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0, streamed=streamed
    )
    return Request(rid, prompt, params, frozenset({EOS}), max_model_len=256)


def fake_run(out: SchedulerOutput, rng: random.Random) -> RunnerOutput:
    """What a runner would sample: one token for each chunk that reaches its request's end."""
    sampled = [
        (s, SamplerOutput([rng.randrange(VOCAB)], [None])) for s in out.scheduled if s.samples
    ]
    return RunnerOutput(sampled=sampled)


def check(sched: Scheduler, out: SchedulerOutput | None = None) -> None:
    kv, pool = sched.kv, sched.kv.pool
    live = [*sched.waiting, *sched.running]
    assert {r.request_id for r in live} == set(sched.requests)
    assert len({r.request_id for r in live}) == len(live), "a request queued twice"
    assert len(sched.running) <= sched.max_num_seqs
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert 0 <= r.num_computed_tokens <= r.num_tokens
        assert len(kv.block_ids(r.request_id)) * kv.block_size >= r.num_computed_tokens
    for r in sched.waiting:
        assert r.status == RequestStatus.WAITING
    # every block is free (ref 0) or held by exactly as many tables as its ref count
    holders: dict[int, int] = {}
    for table in kv.block_tables.values():
        for block in table:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block.block_id
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    if out is not None:
        assert out.num_tokens <= sched.budget.max_tokens
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            r = s.request
            assert s.num_new_tokens > 0
            assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
            assert len(kv.block_ids(r.request_id)) * kv.block_size >= (
                r.num_computed_tokens + s.num_new_tokens
            )


def drain(sched: Scheduler, rng: random.Random, steps: int) -> None:
    """Steps (each checked, tokens from `fake_run`) until nothing is unfinished, `steps` at
    most."""
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check(sched, out)
        sched.update_from_output(out, fake_run(out, rng))


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    num_blocks=st.integers(11, 24),  # the longest request (30 + 12 tokens) fits alone
    by_deadline=st.booleans(),
    capped=st.booleans(),
    caching=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_add_step_abort_keeps_the_invariants(
    ops, num_blocks, by_deadline, capped, caching, seed
) -> None:
    rng = random.Random(seed)
    budget = CAPPED if capped else 16
    sched = make(num_blocks=num_blocks, budget=budget, by_deadline=by_deadline, caching=caching)
    added: list[Request] = []
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]  # a common prefix: cache hits
    for kind, a, b in ops:
        if kind == "add":
            prompt = (shared[: a // 2] + [rng.randrange(1, VOCAB) for _ in range(a)])[:30]
            r = request(f"r{len(added)}", prompt, max_tokens=b, streamed=a % 2 == 0)
            sched.add(r)
            added.append(r)
            check(sched)
        elif kind == "step":
            for _ in range(a):
                out = sched.schedule()
                check(sched, out)
                sched.update_from_output(out, fake_run(out, rng))
                check(sched)
        elif added:
            sched.finish(added[a % len(added)].request_id, FinishReason.ABORT)
            check(sched)
    # drain: everything admitted finishes with exactly its max_tokens (ignore_eos), even
    # through preemptions, and every block comes back
    drain(sched, rng, 2000)
    assert not sched.has_unfinished()
    for r in added:
        assert r.status == RequestStatus.FINISHED
        if r.finish_reason == FinishReason.LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens
    assert sched.kv.pool.num_free_blocks == num_blocks
    assert not sched.kv.block_tables


def test_a_short_prompt_admitted_first_then_preempted_leaves_the_step() -> None:
    """Hypothesis's example of the random test below, replayed: a short prompt admitted ahead of
    the running prefills is the newest request, so it is the victim when a prefill cannot grow;
    it must leave the step's batch too (it was scheduled and now holds no block table)."""
    rng = random.Random(0)
    sched = make(num_blocks=11, by_deadline=True, caching=False)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    for i, (n, out_tokens) in enumerate(((10, 3), (14, 1), (1, 2))):
        prompt = (shared[: n // 2] + [rng.randrange(1, VOCAB) for _ in range(n)])[:30]
        sched.add(request(f"r{i}", prompt, out_tokens))
        if i == 1:
            out = sched.schedule()
            sched.update_from_output(out, fake_run(out, rng))
    drain(sched, rng, 200)
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 11


def test_a_full_pool_preempts_the_newest_and_it_recomputes() -> None:
    sched = make(num_blocks=6, block_size=4, max_num_seqs=4, budget=64, caching=False)
    a, b = request("a", list(range(1, 9)), 12), request("b", list(range(11, 19)), 12)
    sched.add(a)
    sched.add(b)
    rng = random.Random(0)
    preempted = []
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += out.preempted
        check(sched, out)
        sched.update_from_output(out, fake_run(out, rng))
    assert preempted and set(preempted) <= {"b"}  # the most recently admitted goes first
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert b.num_preemptions >= 1
    assert sched.kv.pool.num_free_blocks == 6


def test_a_cached_prefix_is_found_again_and_counted() -> None:
    sched = make(num_blocks=16, block_size=4, budget=64)
    prompt = list(range(1, 14))  # three full blocks and a partial one
    rng = random.Random(0)
    for rid in ("first", "second"):
        r = request(rid, prompt, 2)
        sched.add(r)
        while sched.has_unfinished():
            out = sched.schedule()
            check(sched, out)
            sched.update_from_output(out, fake_run(out, rng))
    assert r.num_cached_tokens == 12  # the second found the first's full blocks
    assert sched.kv.pool.num_free_blocks == 16


def test_short_prefills_go_before_long_ones() -> None:
    sched = make(num_blocks=64, block_size=4, max_num_seqs=4, budget=8, by_deadline=True)
    long = request("long", list(range(1, 41)), 1)
    sched.add(long)
    sched.schedule()  # the long prompt's first chunk is running
    short = request("short", [7, 8, 9], 1)
    sched.add(short)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled][0] == "short"
    assert out.scheduled[0].num_new_tokens == 3
