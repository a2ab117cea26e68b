"""A served token against the engine step that made it, in one server and one run: streamed
c=1 requests (~256-token unique prompts, 128 tokens, ignore_eos) give TPOT; the server's own
counters (`kvserve:engine_decode_step_seconds`, `kvserve:engine_decode_steps`) give the mean
decode step over the same requests. The difference is what serving adds per token.

    python bench/served_step.py                     # the default server
    python bench/served_step.py --rounds 3 --server "--gguf-int8-activations off" --server ""
    python bench/served_step.py --env OMP_NUM_THREADS=1

Each --server is started once and kept up (default: one, with no arguments); every round runs
each server in turn, the order rotated, so the ratios are same-run ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import statistics

import httpx

from bench import serve as loadgen
from harness.launch import Server


def counters(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for name in ("engine_decode_step_seconds_total", "engine_decode_steps_total"):
        m = re.search(rf"^kvserve:{name} ([0-9.e+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def one_round(base: str, model: str, requests: int, seed: int) -> tuple[float, float]:
    """(served TPOT, mean engine decode step) in seconds over `requests` c=1 streams."""
    args = loadgen.parser().parse_args(
        [
            *("--base-url", base, "--model", model, "--workload", "fixed"),
            *("--concurrency", "1", "--num-requests", str(requests), "--input-len", "256"),
            *("--output-len", "128", "--ignore-eos", "--seed", str(seed), "--quiet"),
        ]
    )
    before = counters(base)
    summary = asyncio.run(loadgen.run(args, 1))
    after = counters(base)
    steps = after["engine_decode_steps_total"] - before["engine_decode_steps_total"]
    seconds = after["engine_decode_step_seconds_total"] - before["engine_decode_step_seconds_total"]
    return summary["tpot_s"]["mean"], seconds / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6, help="c=1 requests a round")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the servers")
    ap.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="ARGS",
        help="one server's arguments, quoted; repeat to compare servers round by round",
    )
    a = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in a.env)
    configs = a.server or [""]
    servers = [Server(shlex.split(c), env=env) for c in configs]
    try:
        models = [s.model_id() for s in servers]
        for s, model in zip(servers, models):
            one_round(s.base, model, 2, seed=99)  # warm-up
        rows: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(servers))}
        for r in range(a.rounds):
            order = list(range(len(servers)))
            order = order[r % len(order) :] + order[: r % len(order)]  # rotated each round
            for i in order:
                rows[i].append(one_round(servers[i].base, models[i], a.requests, seed=r))
    finally:
        for s in servers:
            s.stop()
    means = {}
    for i, config in enumerate(configs):
        for r, (tpot, step) in enumerate(rows[i]):
            name = config or "default"
            print(
                f"[{name}] round {r}: served TPOT {tpot * 1e3:.2f} ms, engine decode step "
                f"{step * 1e3:.2f} ms, serving adds {(tpot - step) * 1e3:.2f} ms"
            )
        tpot = statistics.mean(t for t, _ in rows[i])
        step = statistics.mean(st for _, st in rows[i])
        means[i] = tpot
        print(
            f"[{config or 'default'}] mean: served TPOT {tpot * 1e3:.2f} ms, engine step "
            f"{step * 1e3:.2f} ms, +{(tpot - step) * 1e3:.2f} ms"
        )
    for i in range(1, len(configs)):
        print(
            f"TPOT [{configs[i] or 'default'}] / [{configs[0] or 'default'}]: "
            f"{means[i] / means[0]:.2f}x (same run, rounds interleaved)"
        )


if __name__ == "__main__":
    main()
