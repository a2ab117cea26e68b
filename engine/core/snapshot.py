"""A plain-data picture of a running engine for /v1/stats, /metrics and the page. Taken on the
engine thread between steps (`LLMEngine.snapshot`, through `AsyncEngine.snapshot`), so it is
consistent and the asyncio side never reads live engine objects. Taking one changes nothing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostTierSnapshot:
    used_bytes: int
    capacity_bytes: int
    block_bytes: int
    saved_blocks: int
    loaded_blocks: int
    evicted_blocks: int
    # swap-in copy latencies: counts per bucket (upper bounds `load_buckets`, then +Inf), sum
    load_buckets: tuple[float, ...] = ()
    load_latency_counts: tuple[int, ...] = ()
    load_seconds: float = 0.0
    # the disk tier under it (engine/kv/disk.py): files refused by their digest (never
    # served), and saves the filesystem refused (disk full, read-only)
    disk_integrity_failures: int = 0
    disk_save_failures: int = 0


@dataclass(frozen=True, slots=True)
class SpecSnapshot:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float
    current_k: int
    accepted_per_position: list[int]
    # per draft source (engine/spec/drafting.py): (draft tokens, accepted tokens)
    by_source: dict[str, tuple[int, int]]
    # the last finished requests: the share of their decode steps each source's drafts won
    # ("none": no draft), and each source's running acceptance for them
    recent_requests: tuple[dict, ...] = ()


@dataclass(frozen=True, slots=True)
class EncoderSnapshot:
    """A vision model's encoder cache (engine/runner/encoder.py)."""

    hits: int  # images whose soft tokens were found in the cache
    encoded: int  # images the encoder ran on
    evicted: int
    used_bytes: int
    capacity_bytes: int
    entries: int


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_pinned_blocks: int  # cached blocks a cache_control breakpoint keeps
    pins_broken: int  # pinned blocks evicted before their time: nothing else was free
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
    step_seconds: float  # wall time inside LLMEngine.step
    decode_steps: int  # steps that scheduled no prompt token
    decode_step_seconds: float
    host: HostTierSnapshot | None
    spec: SpecSnapshot | None
    encoder: EncoderSnapshot | None = None  # None: a text model
