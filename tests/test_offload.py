"""The host-memory tier: write-back on eviction, swap-in on resume, preemption by swap, idle
offload, the disk tier across restarts, and accounting under a random workload."""

from __future__ import annotations

import logging
import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def sessions(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(length)] for _ in range(n)]


def test_session_resumes_from_host_after_device_eviction(llama_dir) -> None:
    prompts = sessions(6, 60)
    big = LLM(str(llama_dir), num_kv_blocks=256, block_size=8)
    expected = [r.outputs[0].token_ids for r in big.generate(prompts, GREEDY)]

    small = LLM(str(llama_dir), num_kv_blocks=24, block_size=8, host_bytes="64MiB")
    first = small.generate(prompts, GREEDY)  # 6 sessions x 9 blocks: far more than 24
    assert small.engine.kv.pool.num_evictions > 0
    assert small.engine.host is not None and small.engine.host.saved_blocks > 0
    # turn 2 of session 0: its blocks left the device pool long ago
    again = small.generate([prompts[0]], GREEDY)[0]
    assert again.num_cached_tokens >= 48
    assert small.engine.kv.hits_by_source["host"] >= 48
    assert again.outputs[0].token_ids == expected[0] == first[0].outputs[0].token_ids
    assert [r.outputs[0].token_ids for r in first] == expected


def test_preemption_by_swap_matches_recompute(llama_dir) -> None:
    prompts = sessions(12, 50, seed=3)
    runs = {}
    for mode in ("swap", "recompute"):
        llm = LLM(
            str(llama_dir), num_kv_blocks=40, block_size=4, host_bytes="64MiB", preemption_mode=mode
        )
        runs[mode] = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
        assert llm.engine.scheduler.num_preemptions > 0
        if mode == "swap":
            assert llm.engine.kv.hits_by_source["host"] > 0
    assert runs["swap"] == runs["recompute"]


def test_idle_offload_frees_device_blocks(llama_dir) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=8, host_bytes="64MiB")
    prompt = sessions(1, 70, seed=5)[0]
    out = llm.generate([prompt], GREEDY)[0]
    history = prompt + out.outputs[0].token_ids
    cached_before = len(llm.engine.kv.pool.cached)
    moved = llm.engine.offload_prefix(history)
    assert moved == len(history) // 8
    assert len(llm.engine.kv.pool.cached) == cached_before - moved
    resumed = llm.generate([history + [5, 6]], GREEDY)[0]
    assert resumed.num_cached_tokens == moved * 8
    assert llm.engine.kv.hits_by_source["host"] == moved * 8


def test_disk_tier_warm_restart_and_bad_files(llama_dir, tmp_path: Path, caplog) -> None:
    prompt = sessions(1, 100, seed=9)[0]
    disk = tmp_path / "kv"
    kw = dict(num_kv_blocks=64, block_size=8, host_bytes="1MiB", disk_path=str(disk))
    first = LLM(str(llama_dir), **kw)
    ref = first.generate([prompt], GREEDY)[0]
    first.engine.shutdown()  # clean shutdown flushes the host tier to disk
    files = sorted(disk.glob("*.kv"))
    assert len(files) >= 12
    second = LLM(str(llama_dir), **kw)
    warm = second.generate([prompt], GREEDY)[0]
    assert warm.num_cached_tokens >= 96
    assert second.engine.kv.hits_by_source["disk"] > 0
    assert warm.outputs[0].token_ids == ref.outputs[0].token_ids
    # truncate one block file and replace another with a foreign header: both skipped
    files[0].write_bytes(files[0].read_bytes()[:100])
    foreign = bytearray(files[1].read_bytes())
    foreign[8] ^= 0xFF  # inside the fingerprint
    files[1].write_bytes(bytes(foreign))
    third = LLM(str(llama_dir), **kw)
    with caplog.at_level(logging.WARNING, logger="kvserve.disk_tier"):
        cold = third.generate([prompt], GREEDY)[0]
    assert cold.outputs[0].token_ids == ref.outputs[0].token_ids
    assert any("skipped" in r.message for r in caplog.records)


_LLMS: dict[str, LLM] = {}


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(4, 40), st.booleans()), min_size=1, max_size=25
    )
)
def test_tiers_never_leak_or_overflow(llama_dir, ops) -> None:
    if "llm" not in _LLMS:
        _LLMS["llm"] = LLM(
            str(llama_dir),
            num_kv_blocks=16,
            block_size=4,
            host_bytes="40KiB",
            max_num_batched_tokens=16,
        )
    engine = _LLMS["llm"].engine
    host = engine.host
    assert host is not None
    base = sessions(6, 40, seed=11)
    for i, (session, length, offload) in enumerate(ops):
        rid = f"{id(ops)}-{i}"
        engine.add_request(
            rid, base[session][:length], SamplingParams(temperature=0.0, max_tokens=3)
        )
        if offload:
            engine.offload_prefix(base[(session + 1) % 6][:length])
        engine.step()
        assert host.used_bytes <= host.capacity_bytes
        assert len(host.index) + len(host.free_slots) == host.num_blocks
        assert list(host.index.values()) == list(dict.fromkeys(host.index.values()))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert not engine.kv.block_tables
