"""A plain-data picture of a running engine for /v1/stats, /metrics and the page. Taken on the
engine thread between steps (`AsyncEngine.snapshot`), so it is consistent and the asyncio side
never reads live engine objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


@dataclass(frozen=True, slots=True)
class HostTierSnapshot:
    used_bytes: int
    capacity_bytes: int
    block_bytes: int
    saved_blocks: int
    loaded_blocks: int
    evicted_blocks: int
    # swap-in copy latencies since the previous snapshot (drained by taking one)
    recent_load_latencies: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SpecSnapshot:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float
    current_k: int
    accepted_per_position: list[int]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_usage: float
    num_blocks: int
    block_size: int
    # one character per block: "2" in use, "1" cached and free, "0" free
    block_map: str
    prefix_cache_queries: int
    prefix_cache_hits: int
    cached_tokens_by_source: dict[str, int]
    prompt_tokens: int
    generation_tokens: int
    steps: int
    host: HostTierSnapshot | None
    spec: SpecSnapshot | None


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    kv, sched, pool = engine.kv, engine.scheduler, engine.kv.pool
    host = None
    if engine.host is not None:
        h = engine.host
        latencies, h.recent_load_latencies = h.recent_load_latencies, []
        host = HostTierSnapshot(
            h.used_bytes,
            h.capacity_bytes,
            h.block_bytes,
            h.saved_blocks,
            h.loaded_blocks,
            h.evicted_blocks,
            latencies,
        )
    spec = None
    if engine.proposer is not None:
        s = engine.proposer.stats
        spec = SpecSnapshot(
            s.num_drafts,
            s.num_draft_tokens,
            s.num_accepted_tokens,
            s.mean_acceptance_length,
            engine.proposer.current_k,
            list(s.accepted_per_position),
        )
    return EngineSnapshot(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        num_preemptions=sched.num_preemptions,
        kv_usage=pool.usage,
        num_blocks=pool.num_blocks,
        block_size=kv.block_size,
        block_map="".join(
            "2" if b.ref_cnt else ("1" if b.block_hash is not None else "0") for b in pool.blocks
        ),
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        cached_tokens_by_source=dict(kv.hits_by_source),
        prompt_tokens=engine.stats.prompt_tokens,
        generation_tokens=engine.stats.generation_tokens,
        steps=engine.stats.steps,
        host=host,
        spec=spec,
    )
