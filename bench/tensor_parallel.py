"""Tensor parallelism on this machine: TP=2 (two ranks, one thread each) against TP=1 (one
process, two threads) on the default model's weights, through the engine API, side by side in
one run (the settings' order alternates by round). Two CPU cores do not reward TP: each rank
reads half the weights with one thread, about as fast as two threads read all of them, and the
ranks sum every layer's output twice, so this is an honest figure, not a target. Prints, per
setting: a 512-token prefill, decode tok/s at batch 1 and 8, and for TP=2 the share of a decode
step rank 0 spends in the layers' sums (waiting for the other rank included). `--gloo` adds TP=2
summing through torch.distributed's gloo instead of shared memory.

    python bench/tensor_parallel.py [--rounds 2] [--gloo] [--quantization none|auto]
                                    [--model DIR]   # another checkpoint (e.g. a Laguna's)
"""

from __future__ import annotations

import argparse
import random
import time
from statistics import median

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM


def measure(llm: LLM, tp: int) -> dict[str, float]:
    rng = random.Random(0)
    top = min(30000, llm.engine.info.vocab_size)  # ids any vocabulary has, past the specials
    prompt = [rng.randrange(100, top) for _ in range(512)]
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
        ps = [[rng.randrange(100, top) for _ in range(16)] for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        reduce_s[0] = 0.0
        t = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        out[f"decode_b{batch}_tok_s"] = batch * 64 / elapsed
        if tp > 1:
            out[f"sum_share_b{batch}"] = reduce_s[0] / elapsed
    if tp > 1:
        llm.engine.model.set_reduce(reduce)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none", help="none: float weights; auto: GGUF")
    ap.add_argument("--gloo", action="store_true", help="also TP=2 summing through gloo")
    ap.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    args = ap.parse_args()
    settings = {"TP=1 (2 threads)": (1, "auto"), "TP=2 shm (1 thread each)": (2, "shm")}
    if args.gloo:
        settings["TP=2 gloo (1 thread each)"] = (2, "gloo")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    for r in range(args.rounds):
        for name in list(settings)[:: 1 if r % 2 == 0 else -1]:
            tp, allreduce = settings[name]
            llm = LLM(
                args.model,
                dtype=args.dtype,
                quantization=args.quantization,
                tensor_parallel_size=tp,
                tensor_parallel_allreduce=allreduce,
                speculative_method="off",
                max_model_len=2048,
            )
            results[name].append(measure(llm, tp))
            llm.engine.shutdown()
            print(f"round {r} {name}: {results[name][-1]}", flush=True)
    base = next(iter(settings))
    print(f"\nmedians; ratios against {base}")
    for name, runs in results.items():
        cells = []
        for key in runs[0]:
            value = median(x[key] for x in runs)
            if key.startswith("sum_share"):
                cells.append(f"{key} {value:.0%}")
            else:
                ratio = value / median(x[key] for x in results[base])
                cells.append(f"{key} {value:.3f} ({ratio:.2f}x)")
        print(f"{name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
