"""Soak test: mixed, partly hostile traffic from many clients against a server with a small
device pool and the host tier on. Checks afterwards that nothing broke and nothing leaked.

    python bench/soak.py --minutes 30            # the full run (default model)
    python bench/soak.py --seconds 20 --model DIR --clients 16   # the shortened CI version

Traffic per client iteration: chat or completions, streaming or not; 20% of streams cut after a
few chunks; 10% malformed requests; occasional bursts beyond the queue bound; prompts sharing a
few long prefixes; and greedy "canary" prompts whose outputs must match a quiet run exactly.
Reports 5xx count (must be 0), canary mismatches (must be 0), blocks in use once idle (must be
0), and server RSS growth between the first and last third of the run (target < 5%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from collections import Counter

import httpx

from harness import sse
from harness.launch import Server
from harness.workload import WORDS

CANARIES = [f"Canary {i}: list three facts about the number {i * 7}." for i in range(4)]
MALFORMED = [
    b"{not json",
    b'{"messages": []}',
    b'{"messages": [{"role": "x", "content": "a"}]}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "n": 1000}',
    b"[]",
    b'{"prompt": [99999999]}',
    b'{"messages": "hello"}',
    # hostile input, round 2: what a JSON encoder would never produce
    b'{"messages": [{"role": "user", "content": "hi \\ud83d there"}]}',
    b'{"messages": [{"role": "system", "content": "\\ude00\\ud83d"}, '
    b'{"role": "user", "content": "a"}], "stream": true}',
    b'{"prompt": "x\\udfff", "stream": true}',
    b'{"prompt": "x", "stop": ["\\ud800"]}',
    b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 20_000 + b"}",
    b'{"prompt": "x", "temperature": NaN}',
    b'{"messages": [{"role": "user"}]}',
    b'{"messages": [{"role": "user", "content": "trunc',
    b'{"prompt": "ok", "max_tokens": 4, "n": "2"}',
    b'\xff\xfe{"prompt": "x"}',
]
MALFORMED_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+)", f.read())
    return int(m.group(1)) if m else 0


async def canary_outputs(client: httpx.AsyncClient, max_tokens: int) -> list[str]:
    outs = []
    for c in CANARIES:
        r = await client.post(
            "/v1/completions", json={"prompt": c, "max_tokens": max_tokens, "temperature": 0}
        )
        r.raise_for_status()
        outs.append(r.json()["choices"][0]["text"])
    return outs


class Soak:
    def __init__(self, base: str, clients: int, duration: float, max_tokens: int, seed: int):
        self.base, self.clients, self.duration = base, clients, duration
        self.max_tokens, self.seed = max_tokens, seed
        self.status: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self.canary_mismatch = 0
        self.expected: list[str] = []
        rng = random.Random(seed)
        self.prefixes = [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(3)]

    def record(self, kind: str, status: int) -> None:
        self.kinds[kind] += 1
        self.status[status] += 1

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.10:
            r = await client.post(
                rng.choice(MALFORMED_ROUTES),
                content=rng.choice(MALFORMED),
                headers={"Content-Type": "application/json"},
            )
            self.record("malformed", r.status_code)
            return
        if roll < 0.18:
            i = rng.randrange(len(CANARIES))
            r = await client.post(
                "/v1/completions",
                json={"prompt": CANARIES[i], "max_tokens": self.max_tokens, "temperature": 0},
            )
            self.record("canary", r.status_code)
            if r.status_code == 200 and r.json()["choices"][0]["text"] != self.expected[i]:
                self.canary_mismatch += 1
            return
        chat = rng.random() < 0.5
        stream = rng.random() < 0.6
        text = rng.choice(self.prefixes) + " " + " ".join(rng.choice(WORDS) for _ in range(20))
        body: dict = {
            "max_tokens": rng.randint(4, self.max_tokens),
            "temperature": 0.8,
            "stream": stream,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if not stream:
            r = await client.post(path, json=body)
            self.record("plain", r.status_code)
            return
        cut = rng.random() < 0.2
        async with client.stream("POST", path, json=body) as r:
            n = 0
            async for payload in sse.adata(r):
                n += 1
                if payload != sse.DONE and "error" in json.loads(payload):
                    self.status[500] += 1  # an error event inside a 200 stream
                if cut and n >= 3:
                    break
            self.record("stream-cut" if cut else "stream", r.status_code)

    async def burst(self, client: httpx.AsyncClient) -> None:
        async def fire() -> None:
            r = await client.post("/v1/completions", json={"prompt": "burst", "max_tokens": 8})
            self.record("burst", r.status_code)

        await asyncio.gather(*(fire() for _ in range(40)))

    async def client_loop(self, cid: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + cid)
        async with httpx.AsyncClient(base_url=self.base, timeout=300) as client:
            while time.monotonic() < deadline:
                if cid == 0 and rng.random() < 0.05:
                    await self.burst(client)
                else:
                    await self.one(client, rng)

    async def run(self, pid: int) -> dict:
        async with httpx.AsyncClient(base_url=self.base, timeout=300) as client:
            self.expected = await canary_outputs(client, self.max_tokens)  # the quiet run
        start = time.monotonic()
        deadline = start + self.duration
        samples: list[tuple[float, int]] = []

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                samples.append((time.monotonic() - start, rss_kb(pid)))
                await asyncio.sleep(max(0.5, self.duration / 200))

        await asyncio.gather(
            sample_rss(), *(self.client_loop(c, deadline) for c in range(self.clients))
        )
        async with httpx.AsyncClient(base_url=self.base, timeout=60) as client:
            for _ in range(200):
                metrics = (await client.get("/metrics")).text
                running = float(
                    re.search(r"^kvserve:num_requests_running (\S+)$", metrics, re.M).group(1)
                )
                waiting = float(
                    re.search(r"^kvserve:num_requests_waiting (\S+)$", metrics, re.M).group(1)
                )
                if running == 0 and waiting == 0:
                    break
                await asyncio.sleep(0.1)
            usage = float(re.search(r"^kvserve:kv_cache_usage_perc (\S+)$", metrics, re.M).group(1))
            final = await canary_outputs(client, self.max_tokens)
        third = max(1, len(samples) // 3)
        first = statistics.mean(kb for _, kb in samples[:third])
        last = statistics.mean(kb for _, kb in samples[-third:])
        return {
            "duration_s": self.duration,
            "clients": self.clients,
            "requests": sum(self.kinds.values()),
            "by_kind": dict(self.kinds),
            "status": {str(k): v for k, v in sorted(self.status.items())},
            "server_errors": sum(v for k, v in self.status.items() if k >= 500),
            "canary_mismatches": self.canary_mismatch
            + sum(a != b for a, b in zip(final, self.expected, strict=True)),
            "idle_running": running,
            "idle_waiting": waiting,
            "idle_kv_usage": usage,
            "rss_first_third_mb": first / 1024,
            "rss_last_third_mb": last / 1024,
            "rss_growth": last / first - 1,
            # a leak climbs to the end; allocator warm-up flattens out
            "rss_timeline_mb": [
                round(samples[int(i * (len(samples) - 1) / 9)][1] / 1024) for i in range(10)
            ],
        }


def run_soak(
    model: str | None, seconds: float, clients: int, max_tokens: int, extra: list[str]
) -> dict:
    args = [
        # float32: the canaries compare exact greedy outputs, which only float32 keeps whatever
        # a prompt is chunked and batched with (in bf16 a near-tie can flip between chunkings:
        # a numeric property, not the cross-request corruption the canaries are there to catch)
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "48",
        "--host-bytes",
        "512MiB",
        "--max-queue-len",
        "16",
        "--max-num-seqs",
        "16",
        *extra,
    ]
    if model:
        args += ["--model", model]
    with Server(args) as server:
        return asyncio.run(Soak(server.base, clients, seconds, max_tokens, 0).run(server.proc.pid))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--minutes", type=float, default=0)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seconds = args.minutes * 60 if args.minutes else args.seconds
    result = run_soak(args.model, seconds, args.clients, args.max_tokens, [])
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
