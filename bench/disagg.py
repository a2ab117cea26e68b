"""Prefill/decode disaggregation vs one colocated instance, side by side in one run.

Colocated: one kvserve using both cores. Disaggregated: a prefill instance pinned to core 0 and a
decode instance pinned to core 1 (one thread each), a Redis block store and vllm-router in
front. The same offered load goes to each in turn (rounds alternate): `--streams` steady
decode streams (short prompt, long answer, re-sent as soon as they end) plus a long prompt
(~`--long-tokens`) every `--long-every` seconds. Reported per setup: ITL p50/p99 of the steady
streams, TTFT p50/p99 of the long prompts, output tok/s, and goodput (requests per second that
met TTFT <= 3 s and TPOT <= 100 ms). Then the KV hand-over cost per 1,000 prompt tokens
(publish + fetch, from the instances' metrics) against recomputing them on the decode core.

    python bench/disagg.py [--duration 60] [--rounds 2] [--streams 4] [--long-every 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.cluster import KVStoreProcess, RouterProcess
from harness.launch import Process, kvserve_cmd
from harness.sse import stream
from harness.workload import WORDS

TTFT_SLO, TPOT_SLO = 3.0, 0.100


def kvserve_on(name: str, cores: str, threads: int, args: list[str]) -> Process:
    """kvserve pinned to `cores` with `threads` OpenMP threads."""
    cmd = kvserve_cmd(args)
    env = {"OMP_NUM_THREADS": str(threads)}
    return Process(
        name, lambda port: ["taskset", "-c", cores, *cmd(port)], env, timeout=300, stop_timeout=20
    )


def text_of(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Round:
    steady: list = field(default_factory=list)  # harness.sse.Stream of the steady streams
    long: list = field(default_factory=list)
    seconds: float = 0.0


async def offered_load(base: str, args: argparse.Namespace, seed: int) -> Round:
    rng = random.Random(seed)
    out = Round()
    deadline = time.perf_counter() + args.duration
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:

        async def steady(i: int) -> None:
            while time.perf_counter() < deadline:
                body = {
                    "messages": [{"role": "user", "content": f"{i} " + text_of(rng, 48)}],
                    "max_tokens": args.stream_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                out.steady.append(await stream(client, "/v1/chat/completions", body))

        async def one_long(k: int) -> None:
            doc = f"doc {seed}-{k}: " + text_of(rng, args.long_tokens)
            body = {
                "messages": [{"role": "user", "content": doc}],
                "max_tokens": args.long_answer,
                "temperature": 0,
                "ignore_eos": True,
            }
            out.long.append(await stream(client, "/v1/chat/completions", body))

        start = time.perf_counter()
        tasks = [asyncio.create_task(steady(i)) for i in range(args.streams)]
        k = 0
        while time.perf_counter() < deadline:
            tasks.append(asyncio.create_task(one_long(k)))
            k += 1
            await asyncio.sleep(args.long_every)
        await asyncio.gather(*tasks)
        out.seconds = time.perf_counter() - start
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def tpot(s) -> float:
    n = (s.usage or {}).get("completion_tokens", 0)
    return (s.e2e - s.ttft) / (n - 1) if s.ok and s.ttft is not None and n > 1 else float("inf")


def summarize(rounds: list[Round]) -> dict:
    steady = [s for r in rounds for s in r.steady]
    long = [s for r in rounds for s in r.long]
    done = [s for s in steady + long if s.ok]
    seconds = sum(r.seconds for r in rounds)
    itl = [x for s in steady if s.ok for x in s.itl]
    good = [s for s in done if s.ttft is not None and s.ttft <= TTFT_SLO and tpot(s) <= TPOT_SLO]
    tokens = sum((s.usage or {}).get("completion_tokens", 0) for s in done)
    return {
        "requests": len(steady) + len(long),
        "failed": len(steady) + len(long) - len(done),
        "long_prompt_tokens": statistics.mean(
            [(s.usage or {}).get("prompt_tokens", 0) for s in long if s.ok] or [0]
        ),
        "itl_p50_ms": 1000 * pct(itl, 0.5),
        "itl_p99_ms": 1000 * pct(itl, 0.99),
        "ttft_long_p50_s": pct([s.ttft for s in long if s.ok and s.ttft], 0.5),
        "ttft_long_p99_s": pct([s.ttft for s in long if s.ok and s.ttft], 0.99),
        "ttft_steady_p50_s": pct([s.ttft for s in steady if s.ok and s.ttft], 0.5),
        "output_tok_s": tokens / seconds,
        "goodput_req_s": len(good) / seconds,
        "good": f"{len(good)}/{len(done)}",
    }


def metric_sum(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def handover_cost(prefill: Process, decode: Process, args: argparse.Namespace) -> dict:
    """Seconds per 1,000 prompt tokens: publishing (prefill side) + fetching (decode side),
    from the instances' histograms, vs the decode core computing a fresh long prompt."""
    received = metric_sum(decode.base, "kvserve:kv_transfer_received_tokens_sum")
    fetch = metric_sum(decode.base, "kvserve:kv_transfer_receive_seconds_sum")
    publish = metric_sum(prefill.base, "kvserve:kv_transfer_publish_seconds_sum")
    published = metric_sum(prefill.base, "kvserve:kv_transfer_published_blocks_total")
    block_size = httpx.get(prefill.base + "/v1/stats", timeout=10).json()["block_size"]
    rng = random.Random(999)
    times = []
    for k in range(3):  # a fresh prompt on the decode instance: the store misses, it computes
        doc = f"fresh {k}: " + text_of(rng, args.long_tokens)
        body = {"messages": [{"role": "user", "content": doc}], "max_tokens": 1}
        t = time.perf_counter()
        r = httpx.post(decode.base + "/v1/chat/completions", json=body, timeout=600).json()
        times.append((time.perf_counter() - t) / r["usage"]["prompt_tokens"] * 1000)
    return {
        "fetch_s_per_1k_tokens": 1000 * fetch / received if received else float("nan"),
        "publish_s_per_1k_tokens": 1000 * publish / (published * block_size)
        if published
        else float("nan"),
        "received_tokens": received,
        "recompute_s_per_1k_tokens_decode_core": statistics.median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per setup, alternating")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    ap.add_argument("--long-tokens", type=int, default=1500, help="words (~tokens) per long prompt")
    ap.add_argument("--long-answer", type=int, default=32)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    common = [*model, "--max-num-seqs", "32"]
    seed = ["--kv-hash-seed", "bench-disagg"]
    results: dict[str, list[Round]] = {"colocated": [], "disaggregated": []}
    with KVStoreProcess(maxmemory="4gb") as store:
        store_args = ["--kv-store-url", store.url, *seed]
        with (
            kvserve_on("colocated", "0,1", 2, common) as both,
            # smaller prefill chunks: a short prompt waits at most one chunk behind a long one
            kvserve_on(
                "prefill",
                "0",
                1,
                [*common, "--role", "prefill", "--max-num-batched-tokens", "256", *store_args],
            ) as p,
            kvserve_on("decode", "1", 1, [*common, "--role", "decode", *store_args]) as d,
            RouterProcess.pd([p.base], d.base) as router,
        ):
            for r in range(args.rounds):
                for name, base in (("colocated", both.base), ("disaggregated", router.base)):
                    print(f"round {r + 1}: {name} ...", flush=True)
                    results[name].append(asyncio.run(offered_load(base, args, seed=r)))
            cost = handover_cost(p, d, args)
    summary = {name: summarize(rounds) for name, rounds in results.items()}
    col, dis = summary["colocated"], summary["disaggregated"]
    ratios = {
        "goodput_x": dis["goodput_req_s"] / max(col["goodput_req_s"], 1e-9),
        "itl_p99_ratio": dis["itl_p99_ms"] / col["itl_p99_ms"],
        "output_tok_s_x": dis["output_tok_s"] / col["output_tok_s"],
        "ttft_long_p50_x": dis["ttft_long_p50_s"] / col["ttft_long_p50_s"],
    }
    out = {"args": vars(args), "setups": summary, "ratios": ratios, "handover": cost}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
