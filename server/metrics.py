"""Prometheus metrics with `kvserve:` names mirroring vLLM's. Engine counters are read at scrape
time by a collector (no locking on the hot path); latency histograms are observed per request by
the HTTP layer."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.llm_engine import LLMEngine

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class EngineCollector(Collector):
    def __init__(self, get_engine: Callable[[], LLMEngine | None]) -> None:
        self.get_engine = get_engine
        self.on_swap_in: Callable[[float], None] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engine = self.get_engine()
        if engine is None:
            return
        sched, kv, stats = engine.scheduler, engine.kv, engine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvserve:{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvserve:{name}", doc, value=value)

        yield gauge("num_requests_running", "Requests in the running batch.", sched.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", sched.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", kv.pool.usage)
        yield gauge("kv_cache_num_blocks", "KV blocks in the device pool.", kv.pool.num_blocks)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            kv.prefix_queries,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_hits
        )
        yield counter(
            "num_preemptions", "Requests preempted for lack of KV blocks.", sched.num_preemptions
        )
        yield counter("prompt_tokens", "Prompt tokens computed.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("engine_steps", "Engine steps run.", stats.steps)
        cached = CounterMetricFamily(
            "kvserve:cached_tokens", "Prompt tokens served from a cache tier.", labels=["source"]
        )
        for source, value in kv.hits_by_source.items():
            cached.add_metric([source], value)
        yield cached
        if engine.proposer is not None:
            yield from _spec_metrics(engine.proposer, gauge, counter)
        host = engine.host
        if host is not None:
            yield gauge("host_kv_used_bytes", "Bytes of KV held in the host tier.", host.used_bytes)
            yield gauge(
                "host_kv_capacity_bytes", "Host tier capacity in bytes.", host.capacity_bytes
            )
            yield counter(
                "host_kv_offload_blocks", "Blocks copied to the host tier.", host.saved_blocks
            )
            yield counter(
                "host_kv_offload_bytes",
                "Bytes copied to the host tier.",
                host.saved_blocks * host.block_bytes,
            )
            yield counter(
                "host_kv_swap_in_blocks",
                "Blocks copied back from the host tier.",
                host.loaded_blocks,
            )
            yield counter(
                "host_kv_swap_in_bytes",
                "Bytes copied back from the host tier.",
                host.loaded_blocks * host.block_bytes,
            )
            yield counter(
                "host_kv_evictions", "Blocks evicted from the host tier.", host.evicted_blocks
            )
            if self.on_swap_in is not None:
                latencies, host.recent_load_latencies = host.recent_load_latencies, []
                for seconds in latencies:
                    self.on_swap_in(seconds)


class Metrics:
    def __init__(self, get_engine: Callable[[], LLMEngine | None]) -> None:
        self.registry = CollectorRegistry()
        collector = EngineCollector(get_engine)
        self.registry.register(collector)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(
                f"kvserve:{name}", doc, registry=self.registry, buckets=_LATENCY_BUCKETS
            )

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between streamed tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first step.")
        self.swap_in = Histogram(
            "kvserve:host_kv_swap_in_seconds",
            "Latency of one host-to-device swap-in copy.",
            registry=self.registry,
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1),
        )
        collector.on_swap_in = self.swap_in.observe


def _spec_metrics(proposer, gauge, counter) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    spec = proposer.stats
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
        proposer.current_k,
    )
    per_pos = CounterMetricFamily(
        "kvserve:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position.",
        labels=["position"],
    )
    for j, value in enumerate(spec.accepted_per_position):
        per_pos.add_metric([str(j)], value)
    yield per_pos
