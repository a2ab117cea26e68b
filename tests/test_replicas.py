"""Scale-out: three kvserve replicas behind vllm-router with session affinity. Multi-turn
sessions keyed by X-Session-ID stay on their replica, so every later turn meets its earlier
turns' KV in that replica's prefix cache. Every process is stopped by its PID."""

from __future__ import annotations

import httpx
import openai
import pytest

from harness.cluster import RouterProcess
from tests.server_utils import kvserve_server

pytestmark = pytest.mark.slow  # three servers and the router

BS = 16


@pytest.fixture(scope="module")
def replicas(llama_dir):
    opts = {"num_kv_blocks": 512, "block_size": BS}  # every session fits: no eviction
    with (
        kvserve_server(llama_dir, **opts) as a,
        kvserve_server(llama_dir, **opts) as b,
        kvserve_server(llama_dir, **opts) as c,
    ):
        with RouterProcess.replicas([a.base, b.base, c.base]) as router:
            yield router, [a, b, c]


def num_served(server) -> float:
    text = httpx.get(server.base + "/metrics", timeout=10).text
    prefix = "kvserve:e2e_request_latency_seconds_count"
    return float(next(x for x in text.splitlines() if x.startswith(prefix)).split()[-1])


def test_sessions_keep_their_replica(replicas) -> None:
    router, servers = replicas
    client = openai.OpenAI(base_url=router.base + "/v1", api_key="x")
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    home: dict[int, int] = {}  # session -> the replica that served its first turn
    last_prompt: dict[int, int] = {}  # session -> its previous turn's prompt tokens
    for turn in range(3):
        for s, word in enumerate(words):
            history = [
                {"role": "user", "content": f"{word} " * 40 + f"turn {t}"} for t in range(turn + 1)
            ]
            before = [num_served(x) for x in servers]
            r = client.chat.completions.create(
                model="",
                messages=history,
                max_tokens=4,
                temperature=0,
                extra_headers={"X-Session-ID": f"session-{s}"},
            )
            after = [num_served(x) for x in servers]
            replica = next(i for i in range(3) if after[i] > before[i])
            previous, last_prompt[s] = last_prompt.get(s, 0), r.usage.prompt_tokens
            if turn == 0:
                home[s] = replica
                continue
            assert replica == home[s]
            # the previous turn's prompt (less its closing generation prompt, in full blocks)
            # was found on that replica
            shared = (previous - 8) // BS * BS
            assert r.usage.prompt_tokens_details.cached_tokens >= shared
    assert len(set(home.values())) > 1  # six sessions spread over the replicas
