"""This checkout against another (e.g. `git worktree add /tmp/before HEAD~3`), side by side in
one run, rounds alternating A B, B A: the batch-1 engine step (each tree's own
bench/step_profile.py, in-process, no HTTP) and output tok/s of N concurrent streams through
HTTP (each tree's server on the default model, driven by this tree's bench/serve.py).

    python bench/ab.py --before /tmp/before [--rounds 2] [--concurrency 64]

Prints each round's figures and after/before ratios of the means.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import mean

from bench import cli, serve
from harness.launch import ROOT, Process

STEP = re.compile(r"decode step, batch \d+: ([\d.]+) ms")


def tree_env(tree: Path) -> dict[str, str]:
    """Each tree runs its own code (PYTHONPATH: the venv's editable install maps the packages
    to the checkout it was installed from, and a script's own folder comes first on sys.path,
    not the tree's root); their C++ ops build by content (kernels/build.py), so trees whose
    sources agree share them."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def step_ms(tree: Path, steps: int) -> float:
    out = subprocess.run(
        [sys.executable, "bench/step_profile.py", "--batch", "1", "--steps", str(steps)],
        cwd=tree,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = STEP.search(out)
    if match is None:
        raise RuntimeError(f"no decode-step line from {tree}:\n{out}")
    return float(match.group(1))


def streams(tree: Path, concurrency: int, requests: int, output_len: int) -> tuple[float, float]:
    """(output tok/s, TTFT p50 in seconds) of the wave."""
    cmd = [sys.executable, "-m", "server", "--log-level", "warning"]
    launch = lambda port: [*cmd, "--port", str(port)]  # noqa: E731
    with Process(f"ab-{tree.name}", launch, tree_env(tree), cwd=tree) as server:
        args = serve.parser().parse_args(
            [
                "--base-url",
                server.base,
                "--concurrency",
                str(concurrency),
                "--num-requests",
                str(requests),
                "--input-len",
                "256",
                "--output-len",
                str(output_len),
                "--ignore-eos",
                "--quiet",
                "--seed",
                str(len(tree.name)),
            ]
        )
        summary = asyncio.run(serve.run(args, concurrency))
    if summary.get("errors"):
        raise RuntimeError(f"{tree}: {summary['errors']} failed requests")
    return summary["output_throughput"], summary["ttft_s"]["p50"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="the other checkout")
    cli.add_flags(ap, rounds=2, concurrency=64, requests=128, steps=40, output_len=64)
    a = ap.parse_args()
    trees = {"before": a.before.resolve(), "after": ROOT}
    results = {k: {"step": [], "tok_s": [], "ttft": []} for k in trees}
    for r in range(a.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name in order:
            results[name]["step"].append(step_ms(trees[name], a.steps))
            tok_s, ttft = streams(trees[name], a.concurrency, a.requests, a.output_len)
            results[name]["tok_s"].append(tok_s)
            results[name]["ttft"].append(ttft)
            print(
                f"round {r + 1} {name:6s}: batch-1 step {results[name]['step'][-1]:.1f} ms, "
                f"c={a.concurrency} {tok_s:.1f} output tok/s, TTFT p50 {ttft:.2f} s",
                flush=True,
            )
    b, f = results["before"], results["after"]
    print("\n| | before | after | after/before |\n|---|---|---|---|")
    print(
        f"| batch-1 decode step (ms) | {mean(b['step']):.1f} | {mean(f['step']):.1f} | "
        f"{mean(f['step']) / mean(b['step']):.3f} |"
    )
    print(
        f"| c={a.concurrency} output tok/s | {mean(b['tok_s']):.1f} | {mean(f['tok_s']):.1f} | "
        f"{mean(f['tok_s']) / mean(b['tok_s']):.3f} |"
    )
    print(
        f"| c={a.concurrency} TTFT p50 (s) | {mean(b['ttft']):.2f} | {mean(f['ttft']):.2f} | "
        f"{mean(f['ttft']) / mean(b['ttft']):.3f} |"
    )


if __name__ == "__main__":
    main()
