"""The cost ladder: kvserve's own switches turned on one at a time over one mixed workload, each
rung a fresh server on the default model (float32 weights throughout, so only the switch
changes), in one run.

The workload: N concurrent chat sessions; every session's system prompt is the same RAG-like
text (instructions and a few documents, ~1,000 tokens), each session asks T questions, one turn
after another with an idle gap between turns (a user reading), the history growing. The KV
pool is kept small (--kv-cache-memory) so that idle sessions compete for it, as on a busy
server.

Rungs: 1 contiguous-style baseline (no prefix cache, no host tier, no speculation, a static
batch of 2), 2 paged KV + continuous batching, 3 + prefix cache, 4 + host tier for idle
sessions (offloaded after --idle-gap / 2 s idle), 5 + speculation (suffix and grammar drafts),
6 + bfloat16 KV (half the bytes per token: twice the tokens in the same pool).

For each rung: output tok/s over the run, TTFT p50/p99, the prefix-cache hit rate (cached /
prompt tokens, from `usage`), and the cost per million output tokens at --dollars-per-hour.

    python bench/ladder.py [--sessions 8] [--turns 3] [--idle-gap 3] [--dollars-per-hour 0.10]
        [--plot bench/LADDER.png] [--json out.json]
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx

from bench import cli
from bench.chat_record import chat_record
from harness import sse
from harness.launch import Server
from harness.workload import WORDS

BASE = ["--dtype", "float32", "--kv-cache-memory", "160MiB", "--log-level", "warning"]
RUNGS: list[tuple[str, list[str]]] = [
    (
        "1 contiguous-style baseline",
        ["--no-enable-prefix-caching", "--num-speculative-tokens", "0", "--max-num-seqs", "2"],
    ),
    (
        "2 paged + continuous batching",
        ["--no-enable-prefix-caching", "--num-speculative-tokens", "0"],
    ),
    ("3 + prefix cache", ["--num-speculative-tokens", "0"]),
    ("4 + host tier for idle sessions", ["--num-speculative-tokens", "0", "--host-bytes", "1GiB"]),
    ("5 + speculation", ["--num-speculative-tokens", "8", "--host-bytes", "1GiB"]),
    (
        "6 + bfloat16 KV",
        ["--num-speculative-tokens", "8", "--host-bytes", "1GiB", "--kv-cache-dtype", "bfloat16"],
    ),
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sessions(n: int, turns: int, seed: int = 0) -> tuple[str, list[list[str]]]:
    rng = random.Random(seed)
    docs = "\n\n".join(f"Document {i}:\n{words(rng, 150)}" for i in range(4))
    system = "You are a support assistant. Answer from the documents, briefly.\n" + (
        words(rng, 200) + "\n\n" + docs
    )
    questions = [
        [f"Question {t}: what about {words(rng, 10)}?" for t in range(turns)] for _ in range(n)
    ]
    return system, questions


async def run_session(
    client: httpx.AsyncClient,
    name: str,
    system: str,
    questions: list[str],
    gap: float,
    max_tokens: int,
) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    results = []
    for i, q in enumerate(questions):
        if i:
            await asyncio.sleep(gap)
        messages.append({"role": "user", "content": q})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "user": name}
        s = (await sse.stream(client, "/v1/chat/completions", body)).check()
        messages.append({"role": "assistant", "content": s.text})
        results.append(chat_record(s))
    return results


async def drive(base: str, system: str, questions, gap: float, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        start = time.monotonic()
        per_session = await asyncio.gather(
            *(
                run_session(client, f"user-{i}", system, q, gap, max_tokens)
                for i, q in enumerate(questions)
            )
        )
        wall = time.monotonic() - start
    results = [r for s in per_session for r in s]
    ttfts = sorted(r["ttft"] for r in results)
    # the idle gaps are the users' time, not the server's: tok/s over the wall minus them
    busy = wall - gap * (len(questions[0]) - 1)
    return {
        "output_tok_s": sum(r["completion"] for r in results) / busy,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        "prompt_tokens_mean": statistics.mean(r["prompt"] for r in results),
    }


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["rung"].split(" ", 1)[1] for r in rows]
    a.barh(names, [r["output_tok_s"] for r in rows], color="#2563eb")
    a.set_xlabel("output tok/s")
    a.invert_yaxis()
    b.barh(names, [r["ttft_p50"] for r in rows], color="#93c5fd", label="p50")
    b.set_xlabel("TTFT p50 (s)")
    b.invert_yaxis()
    b.set_yticklabels([])
    fig.suptitle("kvserve cost ladder (SmolLM2-135M, float32 weights, 2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = cli.parser(__doc__, sessions=8, turns=3, idle_gap=3.0, max_tokens=32)
    cli.add_flags(ap, dollars_per_hour=0.10, rungs="1,2,3,4,5,6", plot=None, json=None)
    args = ap.parse_args()
    system, questions = sessions(args.sessions, args.turns)
    wanted = {int(r) for r in args.rungs.split(",")}
    rows = []
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.idle_gap:g} s idle between turns, "
        f"{args.max_tokens} output tokens a turn; ${args.dollars_per_hour:.2f}/hour"
    )
    print(
        f"{'rung':36s} {'out tok/s':>9s} {'TTFT p50':>9s} {'p99':>7s} {'hit rate':>8s} "
        f"{'$/M out':>8s}"
    )
    for name, extra in RUNGS:
        if int(name.split()[0]) not in wanted:
            continue
        idle = ["--idle-seconds", str(args.idle_gap / 2)] if "--host-bytes" in extra else []
        with Server(BASE + extra + idle, timeout=300) as server:
            row = asyncio.run(drive(server.base, system, questions, args.idle_gap, args.max_tokens))
        row["rung"] = name
        row["dollars_per_m_output"] = args.dollars_per_hour / (row["output_tok_s"] * 3600) * 1e6
        rows.append(row)
        print(
            f"{name:36s} {row['output_tok_s']:9.1f} {row['ttft_p50']:8.2f}s "
            f"{row['ttft_p99']:6.2f}s {row['hit_rate']:8.1%} "
            f"{row['dollars_per_m_output']:8.2f}",
            flush=True,
        )
    if rows and rows[0]["rung"].startswith("1"):
        first = rows[0]
        print(
            "against rung 1: "
            + ", ".join(
                f"{r['rung'].split()[0]}: {r['output_tok_s'] / first['output_tok_s']:.2f}x tok/s, "
                f"TTFT p50 {first['ttft_p50'] / r['ttft_p50']:.2f}x"
                for r in rows[1:]
            )
        )
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
