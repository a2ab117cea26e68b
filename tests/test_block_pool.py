"""Block accounting: property tests over random add / abort / step sequences."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.kv.pool import BlockPool

_LLM: dict[str, LLM] = {}


def engine_for(model_dir, caching: bool, **extra):
    """One engine per model, caching switch and `extra` options, kept across hypothesis's
    examples (24 blocks of 4)."""
    key = f"{model_dir}:{caching}:{sorted(extra.items())}"
    if key not in _LLM:
        _LLM[key] = LLM(
            str(model_dir),
            num_kv_blocks=24,
            block_size=4,
            max_num_batched_tokens=32,
            enable_prefix_caching=caching,
            **extra,
        )
    return _LLM[key].engine


def check_invariants(engine) -> None:
    check_pool(engine.kv.pool, engine.kv.block_tables.values())
    window = engine.kv.window
    if window is not None:  # the sliding-window layers' pool: its null block held for good
        check_pool(window.pool, window.tables.values(), reserved=window.null)
        assert set(window.tables) <= set(engine.kv.block_tables)


def check_pool(pool: BlockPool, tables, reserved=None) -> None:
    refs = Counter(b.block_id for table in tables for b in table if b is not reserved)
    for block in pool.blocks:
        held = refs.get(block.block_id, 0) + (block is reserved)
        assert block.ref_cnt == held
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    assert len(pool.cached) == sum(1 for b in pool.blocks if b.block_hash is not None)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(3, 12), min_size=1, max_size=30),
            st.integers(1, 12),
        ),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    ),
    max_size=40,
)


def drive(engine, ops, prefix: str, repeat: int = 1) -> None:
    """Run `ops` (add a prompt, abort one, take steps), then everything to the end, checking
    the invariants after each."""
    live: list[str] = []
    counter = len(engine.scheduler.requests) + 10_000 * id(ops) % 997
    for kind, a, b in ops:
        if kind == "add":
            counter += 1
            rid = f"{prefix}{counter}"
            engine.add_request(rid, a * repeat, SamplingParams(temperature=0.0, max_tokens=b))
            live.append(rid)
        elif kind == "abort" and live:
            engine.abort_request(live.pop(a % len(live)))
        else:
            for _ in range(a):
                for out in engine.step():
                    if out.finished and out.request_id in live:
                        live.remove(out.request_id)
        check_invariants(engine)
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops, caching=st.booleans())
def test_blocks_all_free_after_everything_ends(llama_dir, ops, caching) -> None:
    engine = engine_for(llama_dir, caching)
    drive(engine, ops, "r")
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert engine.reset_prefix_cache()
    assert not engine.kv.pool.cached
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in engine.kv.pool.blocks)


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    """Mistral with an 8-token window, blocks of 4: every layer's KV in the window pool."""
    from tests.conftest import build_model

    return build_model("mistral", tmp_path_factory.mktemp("window8") / "m", sliding_window=8)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops, caching=st.booleans())
def test_window_pool_blocks_all_free_after_everything_ends(windowed_dir, ops, caching) -> None:
    """The same random runs with the window pool: its blocks go back behind the window and at
    the end, prefix hits included, and nothing leaks or is freed twice."""
    engine = engine_for(windowed_dir, caching, max_num_seqs=4)
    assert engine.kv.window is not None
    drive(engine, ops, "w", repeat=3)  # prompts three times as long: past the window
    window = engine.kv.window
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert window.pool.num_free_blocks == window.pool.num_blocks - 1 and not window.tables
    assert engine.reset_prefix_cache()
    assert not window.pool.cached


def test_pool_eviction_order_and_sharing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    for i, block in enumerate(a):
        pool.cache(block, bytes([i]) * 32)
    pool.free(reversed(a))  # tail first: block 2 is evicted first
    assert [b.block_id for b in pool.free_queue.values()] == [3, 2, 1, 0]
    hit = pool.lookup(bytes([0]) * 32)
    assert hit is a[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_id not in pool.free_queue
    fresh = pool.allocate(2)
    assert [b.block_id for b in fresh] == [3, 2]
    assert pool.lookup(bytes([2]) * 32) is None and pool.num_evictions == 1
    assert not pool.reset_prefix_cache()  # blocks in use


def test_pinned_blocks_are_passed_over_until_their_time_or_a_full_pool(monkeypatch) -> None:
    """A pinned cached block outlives LRU eviction while unpinned free blocks remain; it lapses
    at its time, yields (counted) when nothing else is free, and an application's pins beyond
    its share lapse oldest first."""
    from engine.kv import pool as pool_module

    now = [1000.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    pool = BlockPool(8)
    blocks = pool.allocate(8)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]))
    pool.free(blocks)  # all cached and free; LRU order 0..7
    pool.pin([bytes([0]), bytes([1])], ttl_s=60, app="a")
    taken = pool.allocate(4)
    assert [b.block_id for b in taken] == [2, 3, 4, 5]  # the pinned 0 and 1 passed over
    assert pool.lookup(bytes([0])) is not None and pool.pins_broken == 0
    more = pool.allocate(3)  # 6, 7, then one pinned: nothing else is free
    assert [b.block_id for b in more] == [6, 7, 0] and pool.pins_broken == 1
    assert pool.lookup(bytes([0])) is None and pool.lookup(bytes([1])) is not None
    pool.free([*taken, *more])
    for i, b in enumerate([*taken, *more]):
        pool.cache(b, bytes([10 + i]))
    now[0] += 61  # block 1's pin lapses: it is the oldest free block again
    assert pool.allocate(1)[0].block_id == 1 and pool.pins_broken == 1
    pool.max_pinned_blocks = 2
    pool.pin([bytes([10]), bytes([11]), bytes([12])], ttl_s=60, app="b")
    assert set(pool.pins) == {bytes([11]), bytes([12])}  # b's oldest pin lapsed
