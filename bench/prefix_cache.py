"""RAG-like workload against a live kvserve, prefix cache on vs off, in one invocation.

Each request: a fixed ~1,000-token system prompt, 4 documents (~200 tokens each) retrieved from a
pool of 20, and a unique question. Retrieval popularity is Zipf-like (a few documents are
retrieved far more often, as in real RAG traffic) and retrieved documents are placed in id order
(a prefix-friendly ordering many RAG apps use). 8 concurrent clients.

    python bench/prefix_cache.py [--requests 32] [--concurrency 8] [--model PATH]
        [--server-arg=--max-num-batched-tokens=512 ...]

Prints the application-level hit rate (cached / prompt tokens, from `usage`, after warm-up), mean
and p50/p99 TTFT for both runs, and the ratios; then where a request's TTFT goes, from the
server's histograms over the whole run: waiting to be scheduled (queue), first step to first
token (its uncached prompt, computed in steps shared with the other requests), and the rest
(HTTP, tokenizing the chat template).
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time

import httpx

from bench import cli
from bench.chat_record import chat_record
from harness import sse
from harness.launch import Server
from harness.workload import WORDS


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_requests(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    system = "You are a helpful assistant. Answer from the documents.\n" + words(rng, 900)
    docs = [f"Document {i}:\n" + words(rng, 185) for i in range(20)]
    weights = [1 / (k + 1) for k in range(20)]
    out = []
    for i in range(n):
        chosen: set[int] = set()
        while len(chosen) < 4:
            chosen.add(rng.choices(range(20), weights)[0])
        context = "\n\n".join(docs[d] for d in sorted(chosen))
        question = f"Question {i}: what does the text say about {words(rng, 12)}?"
        out.append(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": context + "\n\n" + question},
            ]
        )
    return out


async def one(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return chat_record((await sse.stream(client, "/v1/chat/completions", body)).check())


async def drive(base: str, reqs: list[list[dict]], concurrency: int, max_tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def guarded(m: list[dict]) -> dict:
            async with sem:
                return await one(client, m, max_tokens)

        return await asyncio.gather(*(guarded(m) for m in reqs))


def histogram_means(base: str) -> dict[str, float]:
    """Mean seconds of the server's TTFT, queue and prefill histograms so far."""
    text = httpx.get(base + "/metrics", timeout=10).text
    means = {}
    names = {
        "ttft": "time_to_first_token_seconds",
        "queue": "request_queue_time_seconds",
        "prefill": "request_prefill_time_seconds",
    }
    for key, name in names.items():  # summed over label sets (queue and prefill: by class)
        total = sum(map(float, re.findall(rf"^kvserve:{name}_sum(?:{{.*}})? (\S+)$", text, re.M)))
        n = sum(map(float, re.findall(rf"^kvserve:{name}_count(?:{{.*}})? (\S+)$", text, re.M)))
        means[key] = total / n if n else float("nan")
    return means


def summarize(name: str, results: list[dict], warmup: int, seconds: float) -> dict:
    steady = results[warmup:]
    ttfts = sorted(r["ttft"] for r in steady)  # after warm-up, like the hit rate
    hit = sum(r["cached"] for r in steady) / max(1, sum(r["prompt"] for r in steady))
    # cold: less than half the prompt cached (the documents and question are new to the cache)
    cold = [r["ttft"] for r in steady if r["cached"] < r["prompt"] / 2]
    s = {
        "hit_rate": hit,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "prompt_tokens_mean": statistics.mean(r["prompt"] for r in results),
        "cold_ttft_mean": statistics.mean(cold) if cold else float("nan"),
        "output_tok_s": sum(r["completion"] for r in results) / seconds,
    }
    print(
        f"{name:10s} hit rate {hit:6.1%}  TTFT mean {s['ttft_mean']:.2f}s  "
        f"p50 {s['ttft_p50']:.2f}s  p99 {s['ttft_p99']:.2f}s  "
        f"(prompt {s['prompt_tokens_mean']:.0f} tokens); cold prompts ({len(cold)}) TTFT mean "
        f"{s['cold_ttft_mean']:.2f}s; output {s['output_tok_s']:.1f} tok/s over the run"
    )
    return s


def main() -> None:
    ap = cli.parser(model=None, requests=64, concurrency=8, max_tokens=16, warmup=16)
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="passed to both servers, e.g. --server-arg=--max-num-batched-tokens=512",
    )
    args = ap.parse_args()
    reqs = build_requests(args.requests)
    base_args = (["--model", args.model] if args.model else []) + args.server_arg
    summaries = {}
    for name, extra in (("cache on", []), ("cache off", ["--no-enable-prefix-caching"])):
        with Server(base_args + extra) as server:
            t = time.perf_counter()
            results = asyncio.run(drive(server.base, reqs, args.concurrency, args.max_tokens))
            seconds = time.perf_counter() - t
            parts = histogram_means(server.base)
        summaries[name] = summarize(name, results, args.warmup, seconds)
        rest = parts["ttft"] - parts["queue"] - parts["prefill"]
        print(
            f"{'':10s} TTFT {parts['ttft']:.2f}s = queue {parts['queue']:.2f}s + prefill "
            f"{parts['prefill']:.2f}s + rest {rest:.2f}s (server means over the run)"
        )
    on, off = summaries["cache on"], summaries["cache off"]
    print(
        f"TTFT ratio off/on: mean {off['ttft_mean'] / on['ttft_mean']:.1f}x, "
        f"p50 {off['ttft_p50'] / on['ttft_p50']:.1f}x, p99 {off['ttft_p99'] / on['ttft_p99']:.1f}x"
    )


if __name__ == "__main__":
    main()
