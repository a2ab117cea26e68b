"""A long prompt's served time to first token against the engine's own prefill of it, in one run:
the same ~1,500-token prompts (unique, so no prefix hit) streamed to a kvserve server
(`/v1/completions`, token ids, 4 tokens) and prefilled in this process by `LLM` on the same
settings, the two interleaved round by round so load on a shared machine lands on both alike.

As `bench/compare.py` runs its TTFT rows, each long prompt may follow short ones
(`--short-first`, ~256 tokens each, then half a second) on both sides: what the step budget does
after a short prompt arrived shows in both columns; "alone" is the engine's prefill with no
short prompt before it.

    PYTHONPATH=. python bench/served_vs_engine.py [--rounds 3] [--len 1500] \\
        [--server-arg=--max-num-batched-tokens=2048]

Prints per round: served TTFT, in-process prefill after the same short prompts, and alone
(ms), then the medians and served minus in-process (the target: within 30 ms), and where the
served time went by the server's own log line of each long request: its route's TTFT (request
in to first token out), and within it the engine's queue (arrival to first step) and prefill
(first step to first token); the rest of the route's TTFT is planning before the engine and
delivery after it, the rest of the client's is HTTP and the stream.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import httpx

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from harness import sse
from harness.launch import Server
from harness.workload import chat_prompts
from server.config import load_config

SHORT_LEN = 256
SERVED_LINE = re.compile(r"prompt_tokens=(\d+) .*ttft=([\d.]+)s queue=([\d.]+)s prefill=([\d.]+)s")


def server_side(log: str, prompt_tokens: int, last: int) -> dict[str, float]:
    """Medians (ms) of the server's own timings of its last `last` requests of about
    `prompt_tokens` (the template's turn tokens make each prompt a few tokens longer or
    shorter than the length asked for)."""
    rows = [
        tuple(map(float, m.groups()[1:]))
        for m in SERVED_LINE.finditer(log)
        if abs(int(m[1]) - prompt_tokens) <= 16
    ][-last:]
    if not rows:
        return {}
    return {
        k: 1e3 * statistics.median(r[i] for r in rows)
        for i, k in enumerate(("route", "queue", "prefill"))
    }


def served_ttft(base: str, model: str, ids: list[int]) -> float:
    """Seconds from sending a streamed completion of `ids` to its first token's chunk."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": 4,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        ttft = None
        for payload in sse.data(response):  # read to the end: the request ends before the next
            if ttft is None and payload != sse.DONE and '"choices":[{' in payload.replace(" ", ""):
                ttft = time.perf_counter() - t
        if ttft is not None:
            return ttft
    raise RuntimeError("the stream ended without a token")


def engine_prefill(llm: LLM, ids: list[int]) -> float:
    """Seconds of `LLM.generate` of one token of `ids` (its prefill and first sample)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(ids, params)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--len", type=int, default=1500, help="long prompt tokens")
    ap.add_argument("--short-first", type=int, default=2, help="short prompts before each long")
    ap.add_argument("--server-arg", action="append", default=[], help="one server flag each")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="server start, seconds")
    a = ap.parse_args()
    # the engine settings the server gets from the same flags (config.toml and KVSERVE_* too)
    settings = load_config(a.server_arg).engine
    llm = LLM(**{name: getattr(settings, name) for name in EngineConfig.field_names()})
    print(f"step budget: {llm.engine.scheduler.budget.describe()}", flush=True)
    n_short = a.rounds * a.short_first * 2
    longs = chat_prompts(llm.tokenizer, 3 * a.rounds + 2, (a.len, a.len), (1, 1), seed=11)
    shorts = chat_prompts(llm.tokenizer, n_short + 2, (SHORT_LEN, SHORT_LEN), (1, 1), seed=12)
    longs_ids, shorts_ids = [p for p, _ in longs], [p for p, _ in shorts]
    long_len = len(longs_ids[0])
    print(f"prompts: long {long_len} tokens, short {len(shorts_ids[0])}", flush=True)
    served, after_short, alone = [], [], []
    # at info: the request log lines the server-side split reads
    with Server(a.server_arg, timeout=a.ready_timeout, log_level="info") as server:
        model = server.model_id()
        served_ttft(server.base, model, shorts_ids.pop())  # warm-ups: first-call costs
        engine_prefill(llm, shorts_ids.pop())
        served_ttft(server.base, model, longs_ids.pop())
        engine_prefill(llm, longs_ids.pop())
        for rnd in range(a.rounds):
            sides = ["served", "engine"] if rnd % 2 == 0 else ["engine", "served"]
            for side in sides:
                for _ in range(a.short_first):
                    ids = shorts_ids.pop()
                    if side == "served":
                        served_ttft(server.base, model, ids)
                    else:
                        engine_prefill(llm, ids)
                time.sleep(0.5)
                if side == "served":
                    served.append(served_ttft(server.base, model, longs_ids.pop()))
                else:
                    after_short.append(engine_prefill(llm, longs_ids.pop()))
            # the engine's prefill with no short prompt near (as if it had been long ago)
            llm.engine.scheduler.policy.last_short_arrival = float("-inf")
            alone.append(engine_prefill(llm, longs_ids.pop()))
            print(
                f"round {rnd}: served TTFT {1e3 * served[-1]:.0f} ms, in-process after short "
                f"{1e3 * after_short[-1]:.0f} ms, alone {1e3 * alone[-1]:.0f} ms",
                flush=True,
            )
        side = server_side(server.log(), long_len, a.rounds)
    med = {
        k: 1e3 * statistics.median(v)
        for k, v in (("served", served), ("after", after_short), ("alone", alone))
    }
    print(
        f"median: served {med['served']:.0f} ms, in-process after short {med['after']:.0f} ms, "
        f"alone {med['alone']:.0f} ms; served - alone {med['served'] - med['alone']:+.0f} ms, "
        f"served / alone {med['served'] / med['alone']:.2f}x"
    )
    if side:
        outside = side["route"] - side["queue"] - side["prefill"]
        print(
            f"server side (medians): route TTFT {side['route']:.0f} ms = engine queue "
            f"{side['queue']:.0f} + prefill {side['prefill']:.0f} + planning/delivery "
            f"{outside:.0f}; client minus route {med['served'] - side['route']:+.0f} ms; "
            f"engine prefill served minus in-process after short "
            f"{side['prefill'] - med['after']:+.0f} ms"
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
