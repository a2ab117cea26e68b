"""Speculative decoding on the default model with the shipped EAGLE head, side by side.

Held-out chat prompts (subjects never seen in training), greedy, `--max-tokens` new tokens each.
For each batch size, runs without and with speculation alternately (`--rounds` times, so drift on
a shared machine hits both) and prints output tokens/s for both, their ratio, and the mean
acceptance length (tokens per verification round) and per-position acceptance.

    python bench/speculative.py                  # batch 1 and 8, k <= 4, adaptive as served
    python bench/speculative.py --k 2 --batch-sizes 1
    python bench/speculative.py --pin-k          # k pinned at every batch size
"""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams
from models.eagle.prompts import heldout_prompts


def run_batch(llm: LLM, convs: list, params: SamplingParams, batch: int) -> tuple[int, float]:
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(convs), batch):
        for r in llm.chat(convs[i : i + batch], params):
            tokens += len(r.outputs[0].token_ids)
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--speculative-model", default="")
    ap.add_argument(
        "--max-verify-rows", type=int, default=8, help="adaptive k: batch x (1 + k) within "
        "this (the server default)"
    )  # fmt: skip
    ap.add_argument("--cost-model", action="store_true", help="adaptive k by measured costs")
    ap.add_argument(
        "--pin-k", action="store_true", help="k drafts at every batch size: no cost model, "
        "no row cap (measures the head's acceptance at k)"
    )  # fmt: skip
    args = ap.parse_args()
    convs = [[{"role": "user", "content": p}] for p in heldout_prompts(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    base = LLM()
    spec = LLM(
        speculative_model=args.speculative_model,
        num_speculative_tokens=args.k,
        spec_max_verify_rows=1 << 16 if args.pin_k else args.max_verify_rows,
        spec_cost_model=args.cost_model and not args.pin_k,
    )
    base.chat(convs[0], SamplingParams(max_tokens=4))  # warm-up
    spec.chat(convs[0], SamplingParams(max_tokens=4))
    print(
        f"k = {args.k}, {args.num_prompts} held-out prompts, greedy, {args.max_tokens} max tokens"
    )
    print(f"{'batch':>5} {'base tok/s':>11} {'spec tok/s':>11} {'ratio':>6} {'accept':>6} k/round")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        stats = spec.engine.proposer.stats
        drafts0, accepted0 = stats.num_drafts, stats.num_accepted_tokens
        draft_tokens0 = stats.num_draft_tokens
        per_pos0 = list(stats.accepted_per_position)
        totals = {"base": [0, 0.0], "spec": [0, 0.0]}
        for _ in range(args.rounds):
            for name, llm in (("base", base), ("spec", spec)):
                n, dt = run_batch(llm, convs, params, batch)
                totals[name][0] += n
                totals[name][1] += dt
        b_tps = totals["base"][0] / totals["base"][1]
        s_tps = totals["spec"][0] / totals["spec"][1]
        drafts = stats.num_drafts - drafts0
        accept_len = 1 + (stats.num_accepted_tokens - accepted0) / max(1, drafts)
        per_pos = [
            (a - (per_pos0[j] if j < len(per_pos0) else 0)) / max(1, drafts)
            for j, a in enumerate(stats.accepted_per_position)
        ]
        mean_k = (stats.num_draft_tokens - draft_tokens0) / max(1, drafts)
        print(
            f"{batch:>5} {b_tps:>11.1f} {s_tps:>11.1f} {s_tps / b_tps:>5.2f}x {accept_len:>6.2f}"
            f" {mean_k:.2f}"
        )
        print("      acceptance by draft position: " + " ".join(f"{p:.2f}" for p in per_pos))


if __name__ == "__main__":
    main()
