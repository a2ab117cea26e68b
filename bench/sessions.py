"""Multi-turn chat sessions whose total KV is several times the device pool, with the host tier
off and on, in one invocation.

64 sessions x 4 turns on the default model, driven by 8 concurrent clients that interleave their
sessions round-robin (so a session's blocks have long left the device pool when its next turn
comes). Prints TTFT p50/p99 of turns 2-4 for both runs and the ratio, plus the host-tier hit rate
(host-served tokens over turns 2-4 prompt tokens).

    python bench/sessions.py [--sessions 64] [--clients 8] [--device-blocks 140]
"""

from __future__ import annotations

import asyncio
import random
import re

import httpx

from bench import cli
from harness import sse
from harness.launch import Server
from harness.workload import WORDS


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def turn(client: httpx.AsyncClient, sid: str, messages: list[dict], max_tokens: int):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    s = await sse.stream(client, "/v1/chat/completions", body, headers={"X-Session-ID": sid})
    s.check()
    return (s.ttft if s.ttft is not None else s.e2e), s.text, s.usage


async def run(base: str, n_sessions: int, n_clients: int, turns: int, max_tokens: int):
    rng = random.Random(0)
    # Each session has its own context (a user profile / working document), so sessions share
    # no KV: whatever a session finds cached on its next turn is its own history.
    histories = {
        f"s{i}": [
            {
                "role": "system",
                "content": f"Session {i}. You are a helpful assistant. Context:\n"
                + words(rng, 250),
            }
        ]
        for i in range(n_sessions)
    }
    questions = {sid: [words(rng, 40) + "?" for _ in range(turns)] for sid in histories}
    records: list[tuple[int, float, int, int]] = []  # turn, ttft, prompt, cached

    async def client_loop(client: httpx.AsyncClient, mine: list[str]) -> None:
        for t in range(turns):
            for sid in mine:
                histories[sid].append({"role": "user", "content": questions[sid][t]})
                ttft, text, usage = await turn(client, sid, histories[sid], max_tokens)
                histories[sid].append({"role": "assistant", "content": text})
                records.append(
                    (
                        t,
                        ttft,
                        usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"],
                    )
                )

    sids = list(histories)
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        await asyncio.gather(*(client_loop(client, sids[c::n_clients]) for c in range(n_clients)))
        metrics = (await client.get("/metrics")).text
    return records, metrics


def metric(text: str, pattern: str) -> float:
    m = re.search(rf"^{pattern} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    ap = cli.parser(model=None, sessions=64, clients=8, turns=4, max_tokens=32)
    ap.add_argument("--device-blocks", type=int, default=140, help="64-token device KV blocks")
    ap.add_argument("--host-bytes", default="4GiB")
    args = ap.parse_args()
    common = ["--num-kv-blocks", str(args.device_blocks), "--max-num-seqs", str(args.clients)]
    if args.model:
        common += ["--model", args.model]
    results = {}
    for name, extra in (("offload off", []), ("offload on", ["--host-bytes", args.host_bytes])):
        with Server(common + extra) as server:
            records, metrics = asyncio.run(
                run(server.base, args.sessions, args.clients, args.turns, args.max_tokens)
            )
        later = sorted(r[1] for r in records if r[0] > 0)
        prompt_later = sum(r[2] for r in records if r[0] > 0)
        host = metric(metrics, r'kvserve:cached_tokens_total\{source="host"\}')
        peak_history = max(r[2] for r in records)
        results[name] = (later[len(later) // 2], later[int(0.99 * (len(later) - 1))])
        print(
            f"{name:12s} turns 2-{args.turns} TTFT p50 {results[name][0]:.2f}s "
            f"p99 {results[name][1]:.2f}s  host-tier hit rate {host / prompt_later:.1%}  "
            f"(cached {sum(r[3] for r in records if r[0] > 0) / prompt_later:.1%} of "
            f"{prompt_later} prompt tokens; longest prompt {peak_history})"
        )
    total_kv_tokens = args.sessions * peak_history
    print(
        f"total session KV ~{total_kv_tokens} tokens vs device pool {args.device_blocks * 64} "
        f"tokens ({total_kv_tokens / (args.device_blocks * 64):.1f}x)"
    )
    off, on = results["offload off"], results["offload on"]
    print(f"TTFT ratio off/on: p50 {off[0] / on[0]:.1f}x, p99 {off[1] / on[1]:.1f}x")


if __name__ == "__main__":
    main()
