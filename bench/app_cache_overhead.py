"""What the per-application cache statistics and the cache-breaker detector cost: output tok/s of
N concurrent streams (a shared-prefix workload: every prompt is compared with its application's
recent ones) on the default model through HTTP, with `--app-cache-stats` on and off, side by
side in one run, rounds alternating on off, off on.

    python bench/app_cache_overhead.py [--rounds 2] [--concurrency 64] [--requests 192]
"""

from __future__ import annotations

import argparse
import asyncio
from statistics import mean

from bench import serve
from harness.launch import Process, kvserve_cmd


def tok_s(flag: str, concurrency: int, requests: int) -> float:
    with Process(f"app-cache-{flag}", kvserve_cmd([flag])) as server:
        args = serve.parser().parse_args(
            [
                "--base-url", server.base, "--workload", "shared-prefix",
                "--concurrency", str(concurrency), "--num-requests", str(requests),
                "--input-len", "512", "--output-len", "32", "--ignore-eos", "--quiet",
            ]
        )  # fmt: skip
        summary = asyncio.run(serve.run(args, concurrency))
    if summary.get("errors"):
        raise RuntimeError(f"{flag}: {summary['errors']} failed requests")
    return summary["output_throughput"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=192)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {"--app-cache-stats": [], "--no-app-cache-stats": []}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for flag in order:
            runs[flag].append(tok_s(flag, args.concurrency, args.requests))
            print(f"round {r + 1} {flag}: {runs[flag][-1]:.1f} output tok/s", flush=True)
    on, off = mean(runs["--app-cache-stats"]), mean(runs["--no-app-cache-stats"])
    print(f"on/off: {on / off:.3f} ({on:.1f} vs {off:.1f} output tok/s, c={args.concurrency})")


if __name__ == "__main__":
    main()
