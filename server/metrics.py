"""Prometheus metrics with `kvserve:` names mirroring vLLM's. Engine counters come from the
engine's snapshot, taken on the engine thread at scrape time; latency histograms are observed
per request by the HTTP layer."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.core.snapshot import EngineSnapshot, SpecSnapshot

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class EngineCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None  # set just before each scrape
        # values the remote store refused (engine/kv/remote.py), counted per prefetch by
        # server/kv_transfer.py on the event loop: shown in one family with the disk tier's
        self.remote_integrity_failures = 0

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvserve:{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvserve:{name}", doc, value=value)

        yield gauge("num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", snap.kv_usage)
        yield gauge("kv_cache_num_blocks", "KV blocks in the device pool.", snap.num_blocks)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            snap.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.prefix_cache_hits
        )
        yield counter(
            "num_preemptions", "Requests preempted for lack of KV blocks.", snap.num_preemptions
        )
        yield gauge(
            "kv_pinned_blocks",
            "Cached KV blocks pinned by cache_control breakpoints.",
            snap.num_pinned_blocks,
        )
        yield counter(
            "kv_pins_broken",
            "Pinned KV blocks evicted early: nothing else was free.",
            snap.pins_broken,
        )
        yield counter("prompt_tokens", "Prompt tokens computed.", snap.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", snap.generation_tokens)
        yield counter("engine_steps", "Engine steps run.", snap.steps)
        yield counter("engine_step_seconds", "Wall time inside engine steps.", snap.step_seconds)
        yield counter(
            "engine_decode_steps", "Engine steps that scheduled no prompt token.", snap.decode_steps
        )
        yield counter(
            "engine_decode_step_seconds",
            "Wall time inside engine steps that scheduled no prompt token.",
            snap.decode_step_seconds,
        )
        cached = CounterMetricFamily(
            "kvserve:cached_tokens", "Prompt tokens served from a cache tier.", labels=["source"]
        )
        for source, value in snap.cached_tokens_by_source.items():
            cached.add_metric([source], value)
        yield cached
        if snap.spec is not None:
            yield from _spec_metrics(snap.spec, gauge, counter)
        if (enc := snap.encoder) is not None:  # a vision model's encoded images
            yield counter(
                "encoder_cache_hits",
                "Images whose encoding was found in the encoder cache (not encoded again).",
                enc.hits,
            )
            yield counter("encoder_cache_misses", "Images the vision encoder ran on.", enc.encoded)
            yield counter(
                "encoder_cache_evictions", "Encoded images evicted from the cache.", enc.evicted
            )
            yield gauge("encoder_cache_used_bytes", "Bytes of encoded images held.", enc.used_bytes)
            yield gauge(
                "encoder_cache_capacity_bytes",
                "Encoder cache capacity in bytes.",
                enc.capacity_bytes,
            )
        host = snap.host
        # both tiers always, 0 included, so an alert on rate() works from the first scrape
        integrity = CounterMetricFamily(
            "kvserve:kv_tier_integrity_failures",
            "KV blocks read back from a tier and refused: bytes that failed their digest or "
            "tag (never served; the prefix is recomputed).",
            labels=["tier"],
        )
        integrity.add_metric(["disk"], host.disk_integrity_failures if host else 0)
        integrity.add_metric(["remote"], self.remote_integrity_failures)
        yield integrity
        if host is not None:
            yield gauge("host_kv_used_bytes", "Bytes of KV held in the host tier.", host.used_bytes)
            yield gauge(
                "host_kv_capacity_bytes", "Host tier capacity in bytes.", host.capacity_bytes
            )
            # each direction's copies in blocks and in bytes
            for name, copied, blocks in (
                ("offload", "copied to", host.saved_blocks),
                ("swap_in", "copied back from", host.loaded_blocks),
            ):
                doc = f"{copied} the host tier."
                yield counter(f"host_kv_{name}_blocks", f"Blocks {doc}", blocks)
                yield counter(f"host_kv_{name}_bytes", f"Bytes {doc}", blocks * host.block_bytes)
            yield counter(
                "host_kv_evictions", "Blocks evicted from the host tier.", host.evicted_blocks
            )
            yield counter(
                "disk_kv_save_failures",
                "Blocks the disk tier could not write (disk full, read-only); recomputed later.",
                host.disk_save_failures,
            )
            cumulative = list(itertools.accumulate(host.load_latency_counts))
            yield HistogramMetricFamily(
                "kvserve:host_kv_swap_in_seconds",
                "Latency of one host-to-device swap-in copy.",
                buckets=[
                    *((str(le), n) for le, n in zip(host.load_buckets, cumulative)),
                    ("+Inf", cumulative[-1]),
                ],
                sum_value=host.load_seconds,
            )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.collector = EngineCollector()
        self.registry.register(self.collector)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(
                f"kvserve:{name}", doc, registry=self.registry, buckets=_LATENCY_BUCKETS
            )

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between streamed tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        # by request class: "cached" (the prompt hit the prefix cache) or "cold"; the decode
        # rows' latency is inter_token_latency_seconds
        self.queue = Histogram(
            "kvserve:request_queue_time_seconds",
            "Time from arrival to first step, by class (cached: a prefix hit; cold).",
            ["class"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.prefill = Histogram(
            "kvserve:request_prefill_time_seconds",
            "Time from first step to first token (the uncached prompt, in shared steps), by "
            "class (cached: a prefix hit; cold).",
            ["class"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )

        # prefill/decode disaggregation (server/kv_transfer.py), per request
        reg = self.registry
        short = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1, 3)
        self.kv_received_tokens = Histogram(
            "kvserve:kv_transfer_received_tokens",
            "Prompt tokens whose KV a request received from the remote store.",
            registry=reg,
            buckets=(0, 64, 256, 1024, 4096, 16384),
        )
        self.kv_received_bytes = Histogram(
            "kvserve:kv_transfer_received_bytes",
            "KV bytes a request received from the remote store.",
            registry=reg,
            buckets=(0, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30),
        )
        self.kv_receive_seconds = Histogram(
            "kvserve:kv_transfer_receive_seconds",
            "Time to fetch a request's KV from the remote store into the host tier.",
            registry=reg,
            buckets=short,
        )
        self.kv_publish_seconds = Histogram(
            "kvserve:kv_transfer_publish_seconds",
            "Time to publish a request's prompt KV to the remote store.",
            registry=reg,
            buckets=short,
        )
        self.kv_store_misses, self.kv_published_blocks, self.kv_publish_failures = (
            Counter(f"kvserve:kv_transfer_{name}", doc, registry=reg)
            for name, doc in (
                ("store_misses", "Blocks a request expected from the remote store but missed."),
                ("published_blocks", "Blocks published to the remote store."),
                ("publish_failures", "Requests whose KV could not be published (store failed)."),
            )
        )
        self.kv_fallbacks = Counter(
            "kvserve:kv_transfer_fallbacks",
            "Requests that computed prompt KV themselves instead of receiving it.",
            ["reason"],
            registry=reg,
        )

    def render(self, snapshot: EngineSnapshot | None) -> bytes:
        """The exposition text, engine counters as of `snapshot` (None while loading)."""
        self.collector.snapshot = snapshot
        return generate_latest(self.registry)


def _spec_metrics(
    spec: SpecSnapshot, gauge: Callable, counter: Callable
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    yield counter("spec_decode_num_drafts", "Verification rounds with drafts.", spec.num_drafts)
    yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
    yield counter(
        "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens
    )
    yield gauge(
        "spec_decode_mean_acceptance_length",
        "Tokens emitted per verification round (accepted drafts + 1).",
        spec.mean_acceptance_length,
    )
    yield gauge(
        "spec_decode_num_speculative_tokens",
        "k chosen for the last step by adaptive speculation (0 = off at this batch size).",
        spec.current_k,
    )
    per_pos = CounterMetricFamily(
        "kvserve:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position.",
        labels=["position"],
    )
    for j, value in enumerate(spec.accepted_per_position):
        per_pos.add_metric([str(j)], value)
    yield per_pos
    drafted = CounterMetricFamily(
        "kvserve:spec_decode_draft_tokens_by_source",
        "Draft tokens proposed, by where they came from (grammar, suffix, eagle).",
        labels=["source"],
    )
    accepted = CounterMetricFamily(
        "kvserve:spec_decode_accepted_tokens_by_source",
        "Draft tokens accepted, by where they came from.",
        labels=["source"],
    )
    for source, (num_drafted, num_accepted) in spec.by_source.items():
        drafted.add_metric([source], num_drafted)
        accepted.add_metric([source], num_accepted)
    yield drafted
    yield accepted
