"""Tensor parallelism on this machine: TP=2 (two ranks, one thread each) against TP=1 (one
process, two threads) on the default model's weights, through the engine API, side by side in
one run (rounds alternate 1 2, 2 1). Two CPU cores do not reward TP: each rank reads half the
weights, but the ranks sum every layer's output twice over loopback, so this is an honest
figure, not a target. Prints, per setting: a 512-token prefill, decode tok/s at batch 1 and 8,
and for TP=2 the share of a decode step rank 0 spends in all-reduces (compute skew included).

    python bench/tensor_parallel.py [--rounds 2] [--dtype float32] [--quantization none]
"""

from __future__ import annotations

import argparse
import random
import time
from statistics import median

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def measure(llm: LLM, tp: int) -> dict[str, float]:
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(512)]
    once = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt[:64]], once, use_tqdm=False)  # warm
    t = time.perf_counter()
    llm.generate([prompt], once, use_tqdm=False)
    out = {"prefill_512_s": time.perf_counter() - t}
    reduce_s = [0.0]
    if tp > 1:
        reduce = llm.engine.tp.reduce

        def timed(x):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            y = reduce(x)
            reduce_s[0] += time.perf_counter() - t0
            return y

        llm.engine.model.set_reduce(timed)
    for batch in (1, 8):
        ps = [[rng.randrange(100, 30000) for _ in range(16)] for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        reduce_s[0] = 0.0
        t = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        out[f"decode_b{batch}_tok_s"] = batch * 64 / elapsed
        if tp > 1:
            out[f"allreduce_share_b{batch}"] = reduce_s[0] / elapsed
    if tp > 1:
        llm.engine.model.set_reduce(reduce)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none", help="none: float weights; auto: GGUF")
    args = ap.parse_args()
    results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    for r in range(args.rounds):
        for tp in (1, 2) if r % 2 == 0 else (2, 1):
            llm = LLM(
                dtype=args.dtype, quantization=args.quantization, tensor_parallel_size=tp,
                speculative_method="off", max_model_len=2048,
            )  # fmt: skip
            results[tp].append(measure(llm, tp))
            llm.engine.shutdown()
            print(f"round {r} tp={tp}: {results[tp][-1]}", flush=True)
    keys = list(results[1][0])
    print(f"\n{'metric':<22}{'TP=1 (2 threads)':>18}{'TP=2 (1 thread each)':>22}{'TP2/TP1':>9}")
    for key in keys:
        a = median(x[key] for x in results[1])
        b = median(x[key] for x in results[2])
        print(f"{key:<22}{a:>18.3f}{b:>22.3f}{b / a:>9.2f}")
    for key in ("allreduce_share_b1", "allreduce_share_b8"):
        share = median(x[key] for x in results[2])
        print(f"TP=2 rank 0 in all-reduce, {key[-2:]}: {share:.0%} of decode time")


if __name__ == "__main__":
    main()
