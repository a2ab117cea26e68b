"""Load generator for any OpenAI-compatible server (streaming, httpx, asyncio).

    python bench/serve.py --base-url http://127.0.0.1:8000 --workload random \\
        --concurrency 1,4,16,64 --num-requests 64 --input-len 256 --output-len 128 \\
        --ignore-eos --out run.json --plot run.png

Workloads: `random` (lengths drawn from --input-len/--output-len ranges "lo:hi" or a fixed
number), `fixed` (every prompt the same length, unique content), `shared-prefix` (RAG-like: one
long shared prefix + a unique suffix), `multi-turn` (sessions whose turns grow). Load is a fixed
concurrency (a comma list sweeps the levels in turn), or a Poisson arrival rate (--request-rate);
each run ends after --num-requests or --duration seconds. Per request: TTFT, inter-token
latencies, TPOT, end-to-end latency, and prompt / cached / completion tokens from `usage`.
Every random choice is seeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
from tqdm import tqdm

from harness import sse

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact cache block token"
).split()
SCHEMA_VERSION = 1


@dataclass(slots=True)
class RequestResult:
    ok: bool
    status: int
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (
            (self.e2e - self.ttft) / (self.completion_tokens - 1)
            if self.completion_tokens > 1
            else 0.0
        )


def text_of(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def span(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


class Workload:
    """Yields (session key, messages or prompt, max_tokens); multi-turn sessions grow."""

    def __init__(
        self,
        kind: str,
        input_len: str,
        output_len: str,
        seed: int,
        sessions: int = 8,
        prefix_words: int = 800,
    ):
        self.kind, self.rng = kind, random.Random(seed)
        self.input, self.output = span(input_len), span(output_len)
        self.prefix = text_of(random.Random(seed + 1), prefix_words)
        self.histories: dict[int, list[dict]] = {i: [] for i in range(sessions)}
        self.counter = 0

    def next(self) -> tuple[int | None, list[dict], int]:
        self.counter += 1
        n_in = self.rng.randint(*self.input)
        n_out = self.rng.randint(*self.output)
        # ~1 token per word of this vocabulary, plus ~32 for the chat template (SmolLM2's adds
        # a system prompt); exact lengths come back in `usage`
        words = max(1, n_in - 32)
        if self.kind == "shared-prefix":
            return (
                None,
                [{"role": "user", "content": self.prefix + "\n" + text_of(self.rng, 30)}],
                n_out,
            )
        if self.kind == "multi-turn":
            sid = self.counter % len(self.histories)
            hist = self.histories[sid]
            hist.append({"role": "user", "content": text_of(self.rng, 40)})
            return sid, list(hist), n_out
        unique = f"Request {self.counter}: " + text_of(self.rng, words)
        return None, [{"role": "user", "content": unique}], n_out

    def answered(self, sid: int | None, text: str) -> None:
        if sid is not None:
            self.histories[sid].append({"role": "assistant", "content": text})


async def one_request(
    client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int, ignore_eos: bool
) -> tuple[RequestResult, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    s = await sse.stream(client, "/v1/chat/completions", body)
    usage = s.usage or {}
    res = RequestResult(
        ok=s.ok,
        status=s.status,
        ttft=s.ttft or 0.0,
        e2e=s.e2e,
        itl=s.itl,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        completion_tokens=usage.get("completion_tokens", 0),
        error=s.error,
    )
    return res, s.text


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)

    def stats(values: list[float]) -> dict:
        return {
            "mean": statistics.mean(values) if values else 0.0,
            "p50": pct(values, 0.5),
            "p90": pct(values, 0.9),
            "p99": pct(values, 0.99),
        }

    return {
        "schema_version": SCHEMA_VERSION,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        # what went wrong, so a failure in a comparison can be explained afterwards
        "errors": sorted({f"{r.status}: {r.error}"[:200] for r in results if not r.ok})[:5],
        "duration_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_throughput": out_tokens / wall if wall else 0.0,
        "prompt_tokens": prompt,
        "completion_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_s": stats([r.ttft for r in ok]),
        "itl_s": stats([x for r in ok for x in r.itl]),
        "tpot_s": stats([r.tpot for r in ok if r.completion_tokens > 1]),
        "e2e_s": stats([r.e2e for r in ok]),
    }


async def run(args: argparse.Namespace, concurrency: int | None = None) -> dict:
    """One run at one concurrency level (default: the first of --concurrency)."""
    concurrency = concurrency or args.concurrency[0]
    workload = Workload(
        args.workload, args.input_len, args.output_len, args.seed, args.sessions, args.prefix_words
    )
    arrivals = random.Random(args.seed + 7)
    results: list[RequestResult] = []
    deadline = time.monotonic() + args.duration if args.duration else None
    total = args.num_requests if not deadline else None
    bar = tqdm(total=total, desc=f"{args.workload} c={concurrency}", disable=args.quiet)
    issued = 0
    lock = asyncio.Lock()
    limits = httpx.Limits(max_connections=concurrency + 8)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async with httpx.AsyncClient(
        base_url=args.base_url, timeout=args.timeout, limits=limits, headers=headers
    ) as client:

        async def take() -> tuple[int | None, list[dict], int] | None:
            nonlocal issued
            async with lock:
                if (total is not None and issued >= total) or (
                    deadline and time.monotonic() > deadline
                ):
                    return None
                issued += 1
                return workload.next()

        async def worker() -> None:
            while (item := await take()) is not None:
                sid, messages, n_out = item
                res, text = await one_request(client, args.model, messages, n_out, args.ignore_eos)
                workload.answered(sid, text)
                results.append(res)
                bar.update(1)

        async def poisson() -> None:
            tasks = []
            while (item := await take()) is not None:
                sid, messages, n_out = item

                async def go(sid=sid, messages=messages, n_out=n_out) -> None:
                    res, text = await one_request(
                        client, args.model, messages, n_out, args.ignore_eos
                    )
                    workload.answered(sid, text)
                    results.append(res)
                    bar.update(1)

                tasks.append(asyncio.create_task(go()))
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
            await asyncio.gather(*tasks)

        start = time.perf_counter()
        if args.request_rate:
            await poisson()
        else:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    bar.close()
    summary = summarize(results, wall)
    summary["concurrency"] = concurrency
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
    summary["per_request"] = [asdict(r) | {"tpot": r.tpot} for r in results]
    return summary


def levels(spec: str) -> list[int]:
    values = [int(x) for x in spec.split(",")]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return values


def brief(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("per_request", "config")}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="")
    ap.add_argument("--api-key", default="")
    ap.add_argument(
        "--workload", choices=["random", "fixed", "shared-prefix", "multi-turn"], default="random"
    )
    ap.add_argument("--input-len", default="256", help="tokens, or lo:hi")
    ap.add_argument("--output-len", default="128", help="tokens, or lo:hi")
    ap.add_argument(
        "--concurrency", type=levels, default=[8], help="clients; a comma list sweeps levels"
    )
    ap.add_argument("--prefix-words", type=int, default=800, help="shared-prefix workload")
    ap.add_argument("--sessions", type=int, default=8, help="multi-turn workload")
    ap.add_argument(
        "--request-rate", type=float, default=0.0, help="Poisson req/s (0: closed loop)"
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--duration", type=float, default=0.0, help="seconds (overrides the count)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    ap.add_argument("--plot", default=None, help="PNG: throughput and latency vs concurrency")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.workload == "fixed":
        args.input_len = str(span(args.input_len)[0])
    runs = [asyncio.run(run(args, c)) for c in args.concurrency]
    print(json.dumps([brief(s) for s in runs] if len(runs) > 1 else brief(runs[0]), indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"schema_version": SCHEMA_VERSION, "runs": runs}, f, indent=2)
    if args.plot:
        from bench.plot import plot_levels

        plot_levels({args.base_url: [(s["concurrency"], s) for s in runs]}, args.plot)


if __name__ == "__main__":
    main()
