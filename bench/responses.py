"""Server-held conversations vs resending them: a multi-turn conversation continued through
/v1/responses with `previous_response_id` against the same kind of conversation resent in full
through /v1/chat/completions, with the prefix cache on and (on a second server) off. Requests are
streamed one at a time, the three ways interleaved turn by turn, so they share the machine's
noise.

    python bench/responses.py [--conversations 4] [--turns 4] [--doc-words 500] [--model PATH]

Prints TTFT p50 of turns 2+ for each way, the share of prompt tokens served from cache, and the
ratios against chat with the prefix cache off.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics

import httpx

from bench import cli
from harness import sse
from harness.launch import Server
from harness.workload import WORDS

WAYS = ("responses", "chat, cache on", "chat, cache off")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Conversation:
    """One conversation for one way: a document in the instructions, then questions."""

    def __init__(self, way: str, seed: int, doc_words: int, max_tokens: int) -> None:
        self.way, self.rng, self.max_tokens = way, random.Random(seed), max_tokens
        self.instructions = "Answer briefly from this document.\n" + words(self.rng, doc_words)
        self.messages = [{"role": "system", "content": self.instructions}]
        self.previous: str | None = None

    async def turn(self, client: httpx.AsyncClient, i: int) -> sse.Stream:
        question = f"Question {i}: what does it say about {words(self.rng, 10)}?"
        if self.way == "responses":
            body = {
                "input": question,
                "instructions": self.instructions,
                "previous_response_id": self.previous,
                "max_output_tokens": self.max_tokens,
                "temperature": 0,
            }
            res = (await sse.stream(client, "/v1/responses", body)).check()
            self.previous = res.response_id
            return res
        self.messages.append({"role": "user", "content": question})
        body = {"messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0}
        res = (await sse.stream(client, "/v1/chat/completions", body)).check()
        self.messages.append({"role": "assistant", "content": res.text})
        return res


def cached_share(usage: dict) -> tuple[int, int]:
    if "input_tokens" in usage:
        return usage["input_tokens_details"]["cached_tokens"], usage["input_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


async def run(bases: dict[str, str], args: argparse.Namespace) -> dict[str, list[sse.Stream]]:
    later: dict[str, list[sse.Stream]] = {w: [] for w in WAYS}
    clients = {w: httpx.AsyncClient(base_url=bases[w], timeout=600) for w in WAYS}
    try:
        for c in range(args.conversations):
            convs = {
                w: Conversation(w, 1000 * c + k, args.doc_words, args.max_tokens)
                for k, w in enumerate(WAYS)
            }
            for t in range(args.turns):
                for w in WAYS:
                    res = await convs[w].turn(clients[w], t)
                    if t > 0:
                        later[w].append(res)
    finally:
        for client in clients.values():
            await client.aclose()
    return later


def main() -> None:
    ap = cli.parser(model=None, conversations=4, turns=4, doc_words=500, max_tokens=32)
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    with Server([*model]) as on, Server([*model, "--no-enable-prefix-caching"]) as off:
        bases = {"responses": on.base, "chat, cache on": on.base, "chat, cache off": off.base}
        later = asyncio.run(run(bases, args))
    base = statistics.median(s.ttft or 0 for s in later["chat, cache off"])
    print(f"{args.conversations} conversations x {args.turns} turns, turns 2+ (TTFT p50)")
    print(f"{'way':<18}{'TTFT p50':>10}{'cached':>9}{'vs off':>8}")
    for w in WAYS:
        p50 = statistics.median(s.ttft or 0 for s in later[w])
        hit, total = map(sum, zip(*(cached_share(s.usage or {}) for s in later[w]), strict=True))
        print(f"{w:<18}{p50 * 1000:>8.0f}ms{hit / max(total, 1):>9.0%}{base / p50:>7.2f}x")


if __name__ == "__main__":
    main()
