"""What the per-application cache statistics and the cache-breaker detector cost: output tok/s of
N concurrent streams (a shared-prefix workload: every prompt is compared with its application's
recent ones) on the default model through HTTP, with `--app-cache-stats` on and off, side by
side in one run, rounds alternating on off, off on.

    python bench/app_cache_overhead.py [--rounds 2] [--concurrency 64] [--requests 192]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from statistics import mean

from bench import serve
from harness.launch import Process, kvserve_cmd


def tok_s(flag: str, concurrency: int, requests: int) -> float:
    with Process(f"app-cache-{flag}", kvserve_cmd([flag])) as server:
        args = serve.parser().parse_args(
            [
                "--base-url",
                server.base,
                "--workload",
                "shared-prefix",
                "--concurrency",
                str(concurrency),
                "--num-requests",
                str(requests),
                "--input-len",
                "512",
                "--output-len",
                "32",
                "--ignore-eos",
                "--quiet",
            ]
        )
        summary = asyncio.run(serve.run(args, concurrency))
    if summary.get("errors"):
        raise RuntimeError(f"{flag}: {summary['errors']} failed requests")
    return summary["output_throughput"]


def observe_us(prompt_len: int = 1100, suffix: int = 60, n: int = 2000) -> tuple[float, float]:
    """Microseconds per `observe` on shared-prefix prompts (no break) and on prompts whose
    shared prefix carries a changing token near its start (a break every time)."""
    from prometheus_client import CollectorRegistry

    from engine.core.outputs import PrefixSummary
    from server.app_cache import AppCacheStats

    rng = random.Random(0)
    shared = [rng.randrange(50_000) for _ in range(prompt_len)]
    out = []
    for stamped in (False, True):
        stats = AppCacheStats(CollectorRegistry(), block_size=lambda: 16, decode=str)
        prompts = []
        for i in range(n):
            head = [*shared[:20], 60_000 + i] if stamped else shared[:20]
            unique = [rng.randrange(50_000) for _ in range(suffix)]
            prompts.append(head + shared[20:] + unique)
        hit = PrefixSummary(device=16 if stamped else prompt_len // 16 * 16)
        start = time.perf_counter()
        for p in prompts:
            stats.observe("app", p, hit)
        out.append((time.perf_counter() - start) / n * 1e6)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--micro-only", action="store_true", help="only the in-process cost")
    args = ap.parse_args()
    if args.micro_only:
        plain, broken = observe_us()
        print(f"observe(): {plain:.0f} us per request without a break, {broken:.0f} us with one")
        return
    runs: dict[str, list[float]] = {"--app-cache-stats": [], "--no-app-cache-stats": []}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for flag in order:
            runs[flag].append(tok_s(flag, args.concurrency, args.requests))
            print(f"round {r + 1} {flag}: {runs[flag][-1]:.1f} output tok/s", flush=True)
    on, off = mean(runs["--app-cache-stats"]), mean(runs["--no-app-cache-stats"])
    print(f"on/off: {on / off:.3f} ({on:.1f} vs {off:.1f} output tok/s, c={args.concurrency})")
    plain, broken = observe_us()
    per_s = off / 32  # requests per second at that throughput (32 output tokens each)
    print(
        f"observe(): {plain:.0f} us per request without a break, {broken:.0f} us with one; at "
        f"{per_s:.1f} requests/s that is {per_s * broken / 1e4:.3f}% of one core"
    )


if __name__ == "__main__":
    main()
