"""The agent loop as the workload: a system prompt with several tool schemas, then turns of call →
result → call, N agents at once. Each agent runs its loop twice, side by side in one run: through
/v1/chat/completions resending the whole history, and through /v1/responses continuing by
`previous_response_id` (the server holds the conversation). Every turn forces a call
(`tool_choice: required`) so every agent takes the same number of turns.

    python bench/agents.py [--agents 4] [--turns 5] [--max-tokens 64] [--model PATH]
                           [--cache-off-baseline]

Prints per turn: TTFT p50/p99 (to the call's first byte) and the share of prompt tokens served from
the prefix cache, per way; then turn 2+ against turn 1 and responses against chat. With
`--cache-off-baseline` the same loops run again on a server without the prefix cache (one server
after the other, the same seeds), and turn 2+ TTFT is compared cache on vs off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx

from harness import sse
from harness.launch import Server
from harness.workload import WORDS

TOOLS = [
    ("get_weather", {"city": "string", "unit": "string"}),
    ("search_flights", {"origin": "string", "destination": "string", "date": "string"}),
    ("book_hotel", {"city": "string", "nights": "integer"}),
    ("convert_currency", {"amount": "number", "currency": "string"}),
]
SYSTEM = (
    "You are a travel agent. Plan the user's trip step by step: look up the weather, search "
    "flights, book a hotel and convert the budget, one tool call at a time."
)


def tool_schemas() -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name.replace('_', ' ')} for the trip",
                "parameters": {
                    "type": "object",
                    "properties": {
                        k: {"type": t, "maxLength": 16} if t == "string" else {"type": t}
                        for k, t in params.items()
                    },
                    "required": list(params),
                },
            },
        }
        for name, params in TOOLS
    ]


@dataclass(slots=True)
class Turn:
    ttft: float  # seconds to the first output event (the call's header)
    cached: int
    prompt: int
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    response_id: str = ""


async def chat_turn(client: httpx.AsyncClient, body: dict) -> Turn:
    start, ttft, usage = time.perf_counter(), None, {}
    call = {"id": "", "name": "", "arguments": ""}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for payload in sse.adata(r):
            if payload == sse.DONE:
                break
            chunk = json.loads(payload)
            usage = chunk.get("usage") or usage
            for tc in (
                (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []
            ):
                ttft = ttft or time.perf_counter() - start
                call["id"] = tc.get("id") or call["id"]
                call["name"] = tc["function"].get("name") or call["name"]
                call["arguments"] += tc["function"].get("arguments") or ""
    details = usage["prompt_tokens_details"]
    return Turn(
        ttft or 0.0,
        details["cached_tokens"],
        usage["prompt_tokens"],
        call["id"],
        call["name"],
        call["arguments"],
    )


async def responses_turn(client: httpx.AsyncClient, body: dict) -> Turn:
    start, ttft, turn = time.perf_counter(), None, None
    call: dict = {}
    async with client.stream("POST", "/v1/responses", json=body) as r:
        r.raise_for_status()
        async for payload in sse.adata(r):
            event = json.loads(payload)
            kind = event["type"]
            if kind == "response.output_item.added" and event["item"]["type"] == "function_call":
                ttft = ttft or time.perf_counter() - start
            if kind == "response.output_item.done" and event["item"]["type"] == "function_call":
                call = event["item"]
            if kind in ("response.completed", "response.incomplete"):
                usage = event["response"]["usage"]
                turn = Turn(
                    ttft or 0.0,
                    usage["input_tokens_details"]["cached_tokens"],
                    usage["input_tokens"],
                    call.get("call_id", ""),
                    call.get("name", ""),
                    call.get("arguments", ""),
                    event["response"]["id"],
                )
    assert turn is not None, "the stream ended without its response"
    return turn


def result(rng: random.Random, name: str) -> str:
    return f"{name} result: " + " ".join(rng.choice(WORDS) for _ in range(30))


async def chat_agent(client: httpx.AsyncClient, seed: int, args: argparse.Namespace) -> list[Turn]:
    rng = random.Random(seed)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Plan a trip for traveller {seed}."},
    ]
    turns = []
    for _ in range(args.turns):
        body = {
            "messages": messages,
            "tools": tool_schemas(),
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t = await chat_turn(client, body)
        turns.append(t)
        call = {
            "id": t.call_id,
            "type": "function",
            "function": {"name": t.name, "arguments": t.arguments},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": t.call_id, "content": result(rng, t.name)},
        ]
    return turns


async def responses_agent(
    client: httpx.AsyncClient, seed: int, args: argparse.Namespace
) -> list[Turn]:
    rng = random.Random(seed)
    tools = [{"type": "function", **t["function"]} for t in tool_schemas()]
    turns: list[Turn] = []
    items: list[dict] | str = f"Plan a trip for traveller {seed}."
    for _ in range(args.turns):
        body = {
            "instructions": SYSTEM,
            "input": items,
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_output_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
            "previous_response_id": turns[-1].response_id if turns else None,
        }
        t = await responses_turn(client, body)
        turns.append(t)
        items = [
            {"type": "function_call_output", "call_id": t.call_id, "output": result(rng, t.name)}
        ]
    return turns


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(base: str, args: argparse.Namespace) -> dict[str, list[list[Turn]]]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        jobs = [chat_agent(client, 2 * a, args) for a in range(args.agents)]
        jobs += [responses_agent(client, 2 * a + 1, args) for a in range(args.agents)]
        done = await asyncio.gather(*jobs)
    return {"chat": done[: args.agents], "responses": done[args.agents :]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-off-baseline", action="store_true")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    later = report(args, measure(model, args), "prefix cache on")
    if args.cache_off_baseline:
        off = report(args, measure(model + ["--no-enable-prefix-caching"], args), "cache off")
        for way in later:
            print(f"{way}: turns 2+ TTFT p50, cache on vs off: {later[way] / off[way]:.2f}x")


def measure(server_args: list[str], args: argparse.Namespace) -> dict[str, list[list[Turn]]]:
    with Server(server_args) as server:
        return asyncio.run(run(server.base, args))


def report(
    args: argparse.Namespace, runs: dict[str, list[list[Turn]]], label: str
) -> dict[str, float]:
    """Prints the per-turn table; returns each way's turn 2+ TTFT p50."""
    print(f"[{label}] {args.agents} agents per way, {args.turns} turns, {len(TOOLS)} tools")
    print(f"{'way':<10}{'turn':>5}{'TTFT p50':>10}{'p99':>8}{'cached':>8}")
    p50: dict[str, list[float]] = {}
    for way, agents in runs.items():
        p50[way] = []
        for i in range(args.turns):
            turns = [a[i] for a in agents]
            ttfts = [t.ttft for t in turns]
            share = sum(t.cached for t in turns) / max(1, sum(t.prompt for t in turns))
            p50[way].append(statistics.median(ttfts))
            p99 = pct(ttfts, 0.99)
            print(
                f"{way:<10}{i + 1:>5}{p50[way][-1] * 1000:>8.0f}ms{p99 * 1000:>6.0f}ms{share:>8.0%}"
            )
    later = {way: statistics.median(p50[way][1:]) for way in runs}
    for way in runs:
        print(
            f"{way}: turns 2+ TTFT p50 {later[way] * 1000:.0f} ms"
            f" = {later[way] / p50[way][0]:.2f}x turn 1"
        )
    print(f"responses vs chat resend, turns 2+ TTFT p50: {later['responses'] / later['chat']:.2f}x")
    return later


if __name__ == "__main__":
    main()
