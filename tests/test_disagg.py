"""Prefill/decode disaggregation through vllm-router, on a real Redis block store: greedy
output equal to one colocated instance, the decode instance's prompt cached from the remote
tier, fallbacks when the store or the prefill instance is gone, tenant salts across
instances. Every process is started by harness/cluster.py and stopped by its PID."""

from __future__ import annotations

import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from harness.cluster import KVStoreProcess, RouterProcess, redis_server_bin
from tests.server_utils import kvserve_server

# scripts/test.sh installs redis-server (scripts/system_deps.sh); its strict skips fail a run
# that skipped these
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        redis_server_bin() is None and not os.environ.get("CI"),
        reason="redis-server not installed (apt-get install redis-server)",
    ),
]

SEED = "test-seed"
BS = 16
# host_bytes: the tier a store brings is 1 GiB by default, zeroed at startup (seconds on a VM
# for every instance); the tiny model's blocks need far less
COMMON = {
    "num_kv_blocks": 96,
    "block_size": BS,
    "kv_hash_seed": SEED,
    "log_level": "info",
    "host_bytes": "64MiB",
}


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$"
    return sum(float(m) for m in re.findall(pattern, text, flags=re.M))


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(llama_dir):
    """A store, two prefill instances and a decode instance behind the router, and a colocated
    instance (no store) for reference."""
    with KVStoreProcess(maxmemory="256mb") as store:
        with (
            kvserve_server(llama_dir, role="prefill", kv_store_url=store.url, **COMMON) as p,
            kvserve_server(llama_dir, role="prefill", kv_store_url=store.url, **COMMON) as p2,
            kvserve_server(llama_dir, role="decode", kv_store_url=store.url, **COMMON) as d,
            kvserve_server(llama_dir, **COMMON) as colocated,
        ):
            with RouterProcess.pd([p.base, p2.base], d.base) as router:
                yield {
                    "store": store,
                    "prefill": p,
                    "prefill2": p2,
                    "decode": d,
                    "both": colocated,
                    "router": router,
                }


def complete(base: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_through_the_router_matches_colocated_and_decode_gets_the_prompt(cluster) -> None:
    router, both, decode = cluster["router"], cluster["both"], cluster["decode"]
    messages = [{"role": "user", "content": "alpha beta gamma delta " * 30}]
    kw = {"model": "", "messages": messages, "max_tokens": 16, "temperature": 0}
    expected = openai.OpenAI(base_url=both.base + "/v1", api_key="x").chat.completions.create(**kw)
    received_before = metric(decode.base, "kvserve:cached_tokens_total", '{source="remote"}')
    client = openai.OpenAI(base_url=router.base + "/v1", api_key="x")
    got = client.chat.completions.create(**kw)
    assert got.choices[0].message.content == expected.choices[0].message.content
    prompt = got.usage.prompt_tokens
    assert got.usage.completion_tokens == expected.usage.completion_tokens > 1  # decode's answer
    # (the router puts the prefill instance's prompt_tokens_details into the usage it returns,
    # as vLLM's proxies do: the decode instance's own count is in its metrics)
    # every full block but the one holding the last prompt token came from the store
    received = metric(decode.base, "kvserve:cached_tokens_total", '{source="remote"}')
    assert received - received_before == (prompt - 1) // BS * BS
    assert metric(decode.base, "kvserve:kv_transfer_received_tokens_count") >= 1
    published = sum(
        metric(cluster[k].base, "kvserve:kv_transfer_published_blocks_total")
        for k in ("prefill", "prefill2")
    )
    assert published >= (prompt - 1) // BS
    # streamed through the router too
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert text == expected.choices[0].message.content


def test_worker_protocol_direct(cluster) -> None:
    """The router's two calls by hand: the prefill instance answers params naming its blocks,
    the decode instance given them computes only the tail."""
    p, d, both = cluster["prefill"], cluster["decode"], cluster["both"]
    ids = prompt_ids(150, seed=1)
    first = complete(p.base, ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["kvserve"]["num_blocks"] == 150 // BS
    out = complete(d.base, ids, kv_transfer_params=params)
    assert out["choices"][0]["text"] == complete(both.base, ids)["choices"][0]["text"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 149 // BS * BS


def test_a_response_goes_through_the_pd_pair_like_a_chat(cluster) -> None:
    """/v1/responses takes part in the hand-over: the prefill instance answers params, the
    decode instance given them reads the prompt's blocks from the store."""
    p, d, both = cluster["prefill"], cluster["decode"], cluster["both"]
    body = {"input": "epsilon zeta eta theta " * 30, "max_output_tokens": 12, "temperature": 0}

    def respond(base: str, **extra) -> dict:
        r = httpx.post(base + "/v1/responses", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first = respond(p.base, max_output_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    prompt = first["usage"]["input_tokens"]
    assert params["kvserve"]["num_blocks"] == prompt // BS
    out = respond(d.base, kv_transfer_params=params)
    assert out["usage"]["input_tokens_details"]["cached_tokens"] == (prompt - 1) // BS * BS

    def text(r: dict) -> str:
        return r["output"][0]["content"][0]["text"]

    assert text(out) == text(respond(both.base))


def test_tenant_salts_stay_apart_across_instances(cluster) -> None:
    p, d = cluster["prefill"], cluster["decode"]
    ids = prompt_ids(120, seed=2)
    params = complete(p.base, ids, max_tokens=1, cache_salt="tenant-a")["kv_transfer_params"]
    assert params["kvserve"]["num_blocks"] == 120 // BS
    other = complete(d.base, ids, cache_salt="tenant-b", kv_transfer_params=params)
    # tenant b's hashes differ from tenant a's from the first block on: nothing to receive
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    same = complete(d.base, ids, cache_salt="tenant-a", kv_transfer_params=params)
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 119 // BS * BS
    assert same["choices"][0]["text"] == other["choices"][0]["text"]


def test_mismatched_params_fall_back_to_local_prefill(cluster) -> None:
    p, d = cluster["prefill"], cluster["decode"]
    ids = prompt_ids(100, seed=3)
    params = complete(p.base, ids, max_tokens=1)["kv_transfer_params"]
    before = metric(d.base, "kvserve:kv_transfer_fallbacks_total", '{reason="hash_mismatch"}')
    wrong = {**params, "kvserve": {**params["kvserve"], "last_block_hash": "00" * 32}}
    out = complete(d.base, ids, kv_transfer_params=wrong)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = metric(d.base, "kvserve:kv_transfer_fallbacks_total", '{reason="hash_mismatch"}')
    assert after == before + 1
    other = {**params, "kvserve": {**params["kvserve"], "namespace": "another-model"}}
    out = complete(d.base, prompt_ids(100, seed=4), kv_transfer_params=other)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_transfer_params_without_a_store_are_refused(cluster) -> None:
    r = httpx.post(
        cluster["both"].base + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params"


def test_prefill_instance_killed_mid_run_loses_no_request(cluster) -> None:
    """SIGKILL one prefill instance while requests flow. The router does not retry in PD mode:
    a request caught on the dead instance is a 500 until the health check (1 s) drops it; the
    OpenAI client retries those, and every request finishes with the colocated text. Blocks
    already published outlive their prefill instance (they are in the store)."""
    router, both = cluster["router"], cluster["both"]
    prompts = [prompt_ids(90 + 7 * i, seed=100 + i) for i in range(12)]
    expected = [complete(both.base, ids)["choices"][0]["text"] for ids in prompts]
    client = openai.OpenAI(base_url=router.base + "/v1", api_key="x", max_retries=8)

    def run(ids: list[int]) -> str:
        r = client.completions.create(model="", prompt=ids, max_tokens=12, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(run, ids) for ids in prompts]
        futures[2].result()
        cluster["prefill"].proc.kill()
        got = [f.result() for f in futures]
    assert got == expected


def test_store_killed_requests_still_finish(cluster) -> None:
    """Last in this module: it stops the store. Both instances fall back (the prefill one
    cannot publish, the decode one cannot fetch) and every request finishes with the same
    text as the colocated instance."""
    router, d, both = cluster["router"], cluster["decode"], cluster["both"]
    alive = [cluster[k] for k in ("prefill", "prefill2") if cluster[k].proc.poll() is None]
    cluster["store"].stop()
    ids = prompt_ids(130, seed=5)
    out = complete(router.base, ids)
    assert out["choices"][0]["text"] == complete(both.base, ids)["choices"][0]["text"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert sum(metric(p.base, "kvserve:kv_transfer_publish_failures_total") for p in alive) >= 1
    assert metric(d.base, "kvserve:kv_transfer_fallbacks_total", '{reason="not_published"}') >= 1
    # asked directly (no params), the decode instance tries the store, fails, computes
    out = complete(d.base, prompt_ids(110, seed=6))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(d.base, "kvserve:kv_transfer_fallbacks_total", '{reason="store_error"}') >= 1
