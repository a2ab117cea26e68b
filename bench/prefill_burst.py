"""Long prompts arriving beside streaming clients: what they do to the streams' inter-token
latency, against a live kvserve, in one invocation.

Four clients stream chat answers one after another (c=1 each, ~60-token prompts, 96 tokens
each with `ignore_eos`). First alone for `--seconds`, then as long again while a fifth client
sends a cold ~1,500-token prompt every `--every` seconds (8 tokens, streamed for its TTFT).
Prints the streams' ITL p50 / p99 in both phases and their ratio (the target: p99 under the
burst <= 2x the idle p99), the long prompts' TTFT, and output tok/s of the streams.

    python bench/prefill_burst.py [--seconds 30] [--every 3] [--server-arg=--max-itl-factor=-1 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from harness import sse
from harness.launch import Server
from harness.workload import WORDS


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def chat(
    client: httpx.AsyncClient, rng: random.Random, prompt_words: int, max_tokens: int
) -> sse.Stream:
    """One completed greedy chat stream: a prompt of `prompt_words` random words, exactly
    `max_tokens` out."""
    body = {
        "messages": [{"role": "user", "content": words(rng, prompt_words)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    return (await sse.stream(client, "/v1/chat/completions", body)).check()


async def streamer(client: httpx.AsyncClient, rng: random.Random, until: float, out: dict) -> None:
    while time.monotonic() < until:
        s = await chat(client, rng, 45, 96)
        out["itl"].extend(s.itl)
        out["tokens"] += s.usage["completion_tokens"] if s.usage else 0


async def long_prompts(
    client: httpx.AsyncClient, rng: random.Random, until: float, every: float, out: dict
) -> None:
    while time.monotonic() + every < until:
        await asyncio.sleep(every)
        s = await chat(client, rng, 1100, 8)
        out["ttft"].append(s.ttft if s.ttft is not None else s.e2e)
        out["prompt"].append(s.usage["prompt_tokens"] if s.usage else 0)


async def phase(base: str, seconds: float, every: float | None, seed: int) -> dict:
    out: dict = {"itl": [], "tokens": 0, "ttft": [], "prompt": []}
    until = time.monotonic() + seconds
    rngs = [random.Random(seed * 100 + i) for i in range(5)]
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        tasks = [streamer(client, rngs[i], until, out) for i in range(4)]
        if every is not None:
            tasks.append(long_prompts(client, rngs[4], until, every, out))
        t = time.perf_counter()
        await asyncio.gather(*tasks)
        out["seconds"] = time.perf_counter() - t
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--every", type=float, default=3.0)
    ap.add_argument("--server-arg", action="append", default=[])
    args = ap.parse_args()
    with Server(args.server_arg) as server:
        asyncio.run(phase(server.base, 5.0, None, 9))  # warm-up
        idle = asyncio.run(phase(server.base, args.seconds, None, 1))
        burst = asyncio.run(phase(server.base, args.seconds, args.every, 2))
    for name, r in (("idle", idle), ("burst", burst)):
        print(
            f"{name:6s} streams ITL p50 {1000 * pct(r['itl'], 0.5):.1f} ms  p99 "
            f"{1000 * pct(r['itl'], 0.99):.1f} ms  max {1000 * max(r['itl']):.1f} ms  "
            f"streams {r['tokens'] / r['seconds']:.1f} tok/s"
        )
    if burst["ttft"]:
        print(
            f"long prompts: {len(burst['ttft'])} of ~{statistics.mean(burst['prompt']):.0f} "
            f"tokens, TTFT mean {statistics.mean(burst['ttft']):.2f} s, "
            f"max {max(burst['ttft']):.2f} s"
        )
    print(f"ITL p99 burst/idle: {pct(burst['itl'], 0.99) / pct(idle['itl'], 0.99):.2f}x")


if __name__ == "__main__":
    main()
