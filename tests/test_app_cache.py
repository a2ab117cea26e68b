"""The prefix cache per application (#33): hit rates by X-App, cache breakers named where they
happen, misses by eviction told apart from misses by divergence, bounded metric labels."""

from __future__ import annotations

import re
from array import array

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engine.core.outputs import PrefixSummary
from server.app_cache import MAX_APPS, AppCacheStats, find_break
from tests.server_utils import server_fixture

BLOCK = 8
server = server_fixture(
    num_kv_blocks=64, block_size=BLOCK, max_model_len=512, served_model_name="m"
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
    assert stamped["missed_tokens"]["divergence"] > 4 * 20 and steady["missed_tokens"] == {
        "eviction": 0,
        "divergence": 0,
    }
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
    assert evicted["missed_tokens"]["divergence"] == 0 and not evicted["breakers"], evicted


@pytest.mark.slow
def test_application_names_are_bounded_labels_on_the_metrics_page(server) -> None:
    for i in range(MAX_APPS + 8):
        ask(server, f"many-{i}", "Hi.", "?")
    metrics = httpx.get(server.base + "/metrics").text
    labelled = set(re.findall(r'kvserve:app_prompt_tokens_total\{app="([^"]+)"\}', metrics))
    assert len(labelled) == MAX_APPS + 1 and "other" in labelled
