"""Scale-out: three kvserve replicas behind vllm-router, session affinity vs round robin.

The same multi-turn workload (`--sessions` conversations of `--turns` turns, all running at
once, each a system prompt of its own then turns that resend the whole history) goes through
one router per policy over the same replicas: `consistent_hash` and `sticky_least_loaded`
keyed by each session's X-Session-ID header, and `round_robin`. The replicas'
prefix caches are reset before each run. Reported per policy: the application-level prefix hit
rate (cached prompt tokens / prompt tokens, as the replicas' usage reports them) overall and
over turns 2+, and the TTFT p50/p90 of turns 2+.

    python bench/scaleout.py [--sessions 24] [--turns 4] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

import httpx

from harness.cluster import RouterProcess
from harness.launch import Process, kvserve_cmd
from harness.sse import stream
from harness.workload import WORDS


def replica(i: int, args: list[str]) -> Process:
    return Process(
        f"replica{i}", kvserve_cmd(args), {"OMP_NUM_THREADS": "1"}, timeout=300, stop_timeout=20
    )


async def conversation(client: httpx.AsyncClient, s: int, args, records: list) -> None:
    rng = random.Random(s)
    context = " ".join(rng.choice(WORDS) for _ in range(args.context_words))
    history: list[dict] = [{"role": "system", "content": f"session {s} notes: {context}"}]
    for turn in range(args.turns):
        words = " ".join(rng.choice(WORDS) for _ in range(args.turn_words))
        history.append({"role": "user", "content": f"turn {turn}: {words}"})
        body = {"messages": history, "max_tokens": args.answer_tokens, "temperature": 0}
        res = await stream(client, "/v1/chat/completions", body, {"X-Session-ID": f"s{s}"})
        res.check()
        history.append({"role": "assistant", "content": res.text})
        usage = res.usage or {}
        records.append(
            {
                "turn": turn,
                "prompt": usage.get("prompt_tokens", 0),
                "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                "ttft": res.ttft,
            }
        )


async def run(base: str, args) -> list[dict]:
    records: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(
            *(conversation(client, s, args, records) for s in range(args.sessions))
        )
    return records


def summarize(records: list[dict]) -> dict:
    later = [r for r in records if r["turn"] > 0]
    ttft = sorted(r["ttft"] for r in later)

    def rate(rs: list[dict]) -> float:
        return sum(r["cached"] for r in rs) / max(1, sum(r["prompt"] for r in rs))

    return {
        "requests": len(records),
        "prefix_hit_rate": rate(records),
        "prefix_hit_rate_turns_2plus": rate(later),
        "ttft_turns_2plus_p50_s": ttft[len(ttft) // 2],
        "ttft_turns_2plus_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context-words", type=int, default=200, help="a session's system prompt")
    ap.add_argument("--turn-words", type=int, default=40)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument(
        "--policies",
        default="consistent_hash,sticky_least_loaded,round_robin",
        help="vllm-router policies to compare (the first is the affinity baseline)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="runs per policy, alternating")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    # the default block (64 tokens on CPU) would leave most of a short turn uncacheable
    common = [*model, "--block-size", "16", "--max-num-seqs", "32"]
    policies = args.policies.split(",")
    results: dict[str, list[dict]] = {p: [] for p in policies}
    servers = [replica(i, common) for i in range(args.replicas)]
    routers: list[RouterProcess] = []
    try:
        urls = [s.base for s in servers]
        routers = [RouterProcess.replicas(urls, p) for p in policies]
        for r in range(args.rounds):
            for name, router in zip(policies, routers, strict=True):
                for s in servers:
                    httpx.post(s.base + "/reset_prefix_cache", timeout=30).raise_for_status()
                print(f"round {r + 1}: {name} ...", flush=True)
                results[name] += asyncio.run(run(router.base, args))
    finally:
        for p in [*routers, *servers]:
            p.stop()
    summary = {name: summarize(recs) for name, recs in results.items()}
    base = summary["round_robin"]["ttft_turns_2plus_p50_s"] if "round_robin" in summary else None
    out = {
        "args": vars(args),
        "policies": summary,
        "ttft_turns_2plus_p50_vs_round_robin": {
            name: v["ttft_turns_2plus_p50_s"] / base for name, v in summary.items()
        }
        if base
        else None,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
