"""The prefix cache per application (#33): hit rates by X-App, cache breakers named where they
happen, misses by eviction told apart from misses by divergence, bounded metric labels."""

from __future__ import annotations

import re
from array import array

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engine.core.outputs import PrefixSummary
from server.app_cache import CAUSES, MAX_APPS, AppCacheStats, attribute_misses, find_break
from tests.server_utils import server_fixture

BLOCK = 8
server = server_fixture(
    num_kv_blocks=64, block_size=BLOCK, max_model_len=512, served_model_name="m"
)
# a server of its own: the label test fills the other's application labels
stamps_server = server_fixture(
    num_kv_blocks=256, block_size=BLOCK, max_model_len=512, served_model_name="m"
)

RULES = (
    "You answer questions about the ACME product catalogue. Be brief and precise. Quote "
    "prices in euros, never guess a stock level, and say so when a product is unknown. "
    "Catalogue: anvils, rockets, magnets, roller skates, tornado seeds and portable holes."
)


def ask(server, app: str, system: str, question: str) -> dict:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 1,
    }
    r = httpx.post(server.base + "/v1/chat/completions", json=body, headers={"X-App": app})
    assert r.status_code == 200, r.text
    return r.json()


def apps(server) -> dict:
    return httpx.get(server.base + "/v1/stats").json()["apps"]


# ---- the detector alone ----------------------------------------------------------------------


def tokens(values) -> array:
    return array("q", values)


def test_a_break_is_where_the_prompts_part_and_rejoin() -> None:
    head, tail = list(range(100, 140)), list(range(200, 260))
    old = tokens(head + [1, 2] + tail)
    new = tokens(head + [3, 4, 5] + tail + [7, 8])
    brk = find_break(new, old, block=8)
    assert brk is not None
    assert (brk.position, brk.new_span, brk.old_span, brk.rejoined) == (40, 3, 2, 60)
    assert find_break(tokens(head + tail + [9]), tokens(head + tail), 8) is None  # extends
    assert find_break(tokens(head + list(range(300, 400))), old, 8) is None  # goes its own way


def test_every_missed_token_has_one_cause() -> None:
    # the earlier prompt shares 40 tokens, 3 differ, 60 rejoin, 7 are new; blocks of 16: the
    # hit ends at 32, and the 8 shared tokens of the block where they part are lost to it
    new = tokens(list(range(100, 140)) + [3, 4, 5] + list(range(200, 267)))
    brk = find_break(new, tokens(list(range(100, 140)) + [1, 2] + list(range(200, 260))), 16)
    hit = PrefixSummary(device=32)
    causes = attribute_misses(110, hit, 40, brk, 0, 16)
    assert causes == {
        "first_seen": 3 + 7,
        "divergence": 8 + 60,
        "eviction": 0,
        "uncached": 0,
        "partial_block": 0,
        "salt": 0,
    }
    # the same prompt again, fully cached but its last block (the last token is computed)
    assert attribute_misses(100, PrefixSummary(device=96), 100, None, 0, 8) == {
        **dict.fromkeys(CAUSES, 0),
        "partial_block": 4,
    }
    # an extension of a prompt that is still being computed beside it
    assert attribute_misses(100, PrefixSummary(), 64, None, 0, 8) == {
        **dict.fromkeys(CAUSES, 0),
        "uncached": 64,
        "first_seen": 36,
    }
    # evicted blocks, then another salt's blocks, then new text
    assert attribute_misses(100, PrefixSummary(device=16, evicted=16), 0, None, 60, 8) == {
        **dict.fromkeys(CAUSES, 0),
        "eviction": 16,
        "salt": 24,
        "first_seen": 44,
    }


def test_a_stamp_in_a_short_prompt_is_named_once_it_repeats() -> None:
    """The issue's case on CPU blocks of 64: a ~190-token system prompt whose stamp ~60 tokens
    in breaks its first block; every prompt after the first loses ~185 tokens to it."""
    stats = AppCacheStats(CollectorRegistry(), block_size=lambda: 64, decode=str)
    before, after = list(range(1000, 1060)), list(range(2000, 2125))
    for i in range(4):
        prompt = before + [i, i + 10, i + 20, i + 30, i + 40] + after + [5000 + i]
        stats.observe("stamped", prompt, PrefixSummary())
        app = stats.snapshot()["stamped"]
        assert sum(app["missed_tokens"].values()) == app["prompt_tokens"] - app["cached_tokens"]
        assert bool(app["breakers"]) == (i >= 2), (i, app["breakers"])  # named at the second
    (breaker,) = app["breakers"]
    assert breaker["position"] == 60 and breaker["count"] == 3
    assert app["missed_tokens"]["divergence"] == 3 * (60 + 125)


def test_labels_stay_bounded_under_10000_applications() -> None:
    registry = CollectorRegistry()
    stats = AppCacheStats(registry, block_size=lambda: BLOCK, decode=str)
    for i in range(10_000):
        stats.observe(f"tenant-{i}", [1, 2, 3, 4], PrefixSummary(device=2))
    samples = {
        s.labels["app"]
        for metric in registry.collect()
        if metric.name == "kvserve:app_prompt_tokens"
        for s in metric.samples
    }
    assert len(samples) == MAX_APPS + 1 and "other" in samples
    assert len(stats.snapshot()) == MAX_APPS + 1


# ---- through the server ----------------------------------------------------------------------


@pytest.mark.slow
def test_a_timestamp_in_the_system_prompt_is_named_and_a_steady_one_keeps_its_hits(server):
    questions = ["Price of an anvil?", "Any rockets left?", "Magnets?", "Skates?", "Holes?"]
    for i, q in enumerate(questions):
        ask(server, "stamped", f"Now: 2026-12-01 12:00:0{i}. {RULES}", q)
        ask(server, "steady", RULES, q)
    stats = apps(server)
    stamped, steady = stats["stamped"], stats["steady"]
    assert steady["hit_rate"] > 0.6 and not steady["breakers"], steady
    assert stamped["hit_rate"] < 0.25 < steady["hit_rate"] - 0.35, (stamped, steady)
    assert stamped["missed_tokens"]["divergence"] > 4 * 20, stamped
    assert steady["missed_tokens"]["divergence"] == steady["missed_tokens"]["eviction"] == 0
    for app in (stamped, steady):
        assert sum(app["missed_tokens"].values()) == app["prompt_tokens"] - app["cached_tokens"]
    (breaker,) = stamped["breakers"]
    assert breaker["count"] == 4 and breaker["lost_prefill_tokens"] >= 4 * 20
    # the changing second, shown between the tokens around it in both prompts
    changed = re.search(r"\[(.*?)\]", breaker["new"]).group(1)
    before = re.search(r"\[(.*?)\]", breaker["previous"]).group(1)
    assert changed != before and re.search(r"[0-4]", changed), breaker
    assert "00:0" in breaker["new"].split("[")[0] + changed, breaker

    metrics = httpx.get(server.base + "/metrics").text
    assert 'kvserve:app_cached_tokens_total{app="steady",tier="device"}' in metrics
    assert 'kvserve:app_missed_tokens_total{app="stamped",cause="divergence"}' in metrics
    assert 'kvserve:cache_breaks_total{app="stamped"} 4.0' in metrics


@pytest.mark.slow
def test_a_miss_after_eviction_is_counted_as_eviction(server) -> None:
    system = RULES + " Evicted app."
    ask(server, "evicted", system, "Anvils?")
    for i in range(12):  # other prompts fill the 64-block pool and evict it
        ask(server, "flood", f"Flood {i}: " + " ".join(str(i * 97 + j) for j in range(60)), "?")
    ask(server, "evicted", system, "Anvils?")
    evicted = apps(server)["evicted"]
    assert evicted["missed_tokens"]["eviction"] >= 2 * BLOCK, evicted
    assert sum(evicted["missed_tokens"].values()) == (
        evicted["prompt_tokens"] - evicted["cached_tokens"]
    )
    assert evicted["missed_tokens"]["divergence"] == 0 and not evicted["breakers"], evicted


@pytest.mark.slow
def test_application_names_are_bounded_labels_on_the_metrics_page(server) -> None:
    for i in range(MAX_APPS + 8):
        ask(server, f"many-{i}", "Hi.", "?")
    metrics = httpx.get(server.base + "/metrics").text
    labelled = set(re.findall(r'kvserve:app_prompt_tokens_total\{app="([^"]+)"\}', metrics))
    assert len(labelled) == MAX_APPS + 1 and "other" in labelled


@pytest.mark.slow
def test_misses_by_cause_sum_to_the_misses_wherever_the_stamp_is(stamps_server) -> None:
    """Short and long system prompts with a changing stamp at the start, the middle or the end:
    for every application the causes sum to prompt minus cached tokens, and a stamp that keeps
    breaking a block in the middle is named, whatever the prompt's length."""
    long_rules = " ".join([RULES] * 2)  # the server serves 512 tokens
    for length, rules in (("short", RULES), ("long", long_rules)):
        half = len(rules) // 2
        for i in range(4):
            stamp = f" [id {i}{i * 7}{i * 3}] "
            ask(stamps_server, f"start-{length}", stamp + rules, "Anvils?")
            ask(stamps_server, f"middle-{length}", rules[:half] + stamp + rules[half:], "Anvils?")
            ask(stamps_server, f"end-{length}", rules + stamp, "Anvils?")
    stats = apps(stamps_server)
    for length in ("short", "long"):
        for where in ("start", "middle", "end"):
            app = stats[f"{where}-{length}"]
            missed = app["missed_tokens"]
            assert set(missed) == {
                "first_seen",
                "divergence",
                "eviction",
                "uncached",
                "partial_block",
                "salt",
            }
            assert sum(missed.values()) == app["prompt_tokens"] - app["cached_tokens"], app
        middle = stats[f"middle-{length}"]
        assert middle["breakers"] and middle["missed_tokens"]["divergence"] > 0, middle
        assert stats[f"end-{length}"]["hit_rate"] > middle["hit_rate"], stats
    # queue and prefill time by request class: prompts that hit the cache, and cold ones
    metrics = httpx.get(stamps_server.base + "/metrics").text
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds"):
        for kind in ("cached", "cold"):
            m = re.search(rf'^kvserve:{name}_count{{class="{kind}"}} (\S+)$', metrics, re.M)
            assert m and float(m.group(1)) > 0, (name, kind)
