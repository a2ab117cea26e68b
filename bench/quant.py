"""Precision against float32 on the default model: int8 weights (with float32 or bf16
activations) and bf16, side by side in one run.

    python bench/quant.py            # accuracy on held-out prompts + decode step times
    python bench/quant.py --kernels  # the linear kernels torch offers, on SmolLM2's shapes

Accuracy, per configuration, against float32 on the same weights: over each prompt followed by
float32's own greedy continuation (teacher forcing), the cosine of the next-token logits and how
often their top-1 agrees; then free greedy generation, 32 tokens: how many prompts give the
identical continuation and the mean number of tokens before the first difference. Speed: the
mean decode step at batch 1 and 64 (prompts of 256 tokens).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from harness.workload import chat_prompts

# not the calibration text (models/linear/w8a8.py): other subjects, other shapes
HELD_OUT = [
    "Explain the difference between TCP and UDP in two sentences.",
    "Write a limerick about a cat who learns to code.",
    "What are three good habits for getting better sleep?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Give me a Python function that checks whether a string is a palindrome.",
    "List the planets of the solar system in order from the sun.",
    "Why is the sky blue? Answer for a ten-year-old.",
]
CONFIGS = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8 + float32 act.": {"dtype": "float32", "quantization": "int8"},
    "int8 + bf16 act.": {"dtype": "bfloat16", "quantization": "int8"},
}


def accuracy(llms: dict[str, LLM], new_tokens: int = 32) -> None:
    ref = llms["float32"]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    prompts = [
        ref.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in HELD_OUT
    ]
    ids = [ref.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    ref_out = [r.outputs[0].token_ids for r in ref.generate(ids, greedy)]
    forced = [p + o for p, o in zip(ids, ref_out, strict=True)]
    ref_logits = [score_prompt(ref.engine, f)[len(p) - 1 :] for f, p in zip(forced, ids)]
    print(f"{'config':<22}{'cos mean':>9}{'cos min':>9}{'top-1':>8}{'same 32':>9}{'prefix':>8}")
    for name, llm in llms.items():
        if name == "float32":
            continue
        cos, agree = [], []
        for f, p, r in zip(forced, ids, ref_logits, strict=True):
            got = score_prompt(llm.engine, f)[len(p) - 1 :]
            cos.append(torch.nn.functional.cosine_similarity(got, r, dim=-1))
            agree.append((got.argmax(-1) == r.argmax(-1)).float())
        outs = [r.outputs[0].token_ids for r in llm.generate(ids, greedy)]
        same = sum(o == r for o, r in zip(outs, ref_out, strict=True))
        prefix = [
            next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r))
            for o, r in zip(outs, ref_out, strict=True)
        ]
        c, a = torch.cat(cos), torch.cat(agree)
        print(
            f"{name:<22}{c.mean():>9.4f}{c.min():>9.4f}{a.mean():>8.1%}"
            f"{same:>6}/{len(ids)}{sum(prefix) / len(prefix):>8.1f}"
        )


def step_times(llms: dict[str, LLM], batches: tuple[int, ...] = (1, 64)) -> None:
    print(f"{'config':<22}" + "".join(f"{f'batch {b}':>14}" for b in batches))
    for name, llm in llms.items():
        cells = []
        for b in batches:
            work = chat_prompts(llm.tokenizer, b, (256, 256), (1, 1), seed=3)
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            engine = llm.engine
            for i, (p, _) in enumerate(work):
                engine.add_request(f"{name}-{b}-{i}", p, params)
            sched = engine.scheduler
            while sched.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
            ):
                engine.step()  # prefill
            engine.step()
            t, n = time.perf_counter(), 0
            while engine.has_unfinished():
                engine.step()
                n += 1
            cells.append(f"{(time.perf_counter() - t) / max(n, 1) * 1000:>12.1f}ms")
        print(f"{name:<22}" + "".join(cells))


def kernels() -> None:
    """Each linear kernel over SmolLM2's 30 layers of weights (out of cache), 2 threads."""
    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    weights = [torch.randn(o, i) * 0.02 for o, i in shapes]
    from models.linear.w8a8 import int8_weight, needs_reduce_range

    def packed(dtype: torch.dtype):
        ps = [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 64) for w in weights]
        return lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]].to(dtype), p, None, "none", [], "")
            for w, p in zip(weights, ps, strict=True)
        ]

    def fbgemm():
        qs = [int8_weight(w, None, needs_reduce_range()) for w in weights]
        return lambda xs: [q(xs[w.shape[1]]) for w, q in zip(weights, qs, strict=True)]

    def weight_only():
        qs = []
        for w in weights:
            scale = w.abs().amax(1) / 127
            qs.append(((w / scale[:, None]).round().to(torch.int8), scale.bfloat16()))
        return lambda xs: [
            torch._weight_int8pack_mm(xs[w.shape[1]].bfloat16(), q, s)
            for w, (q, s) in zip(weights, qs, strict=True)
        ]

    kinds = {
        "float32 (oneDNN packed)": packed(torch.float32),
        "bf16 (oneDNN packed)": packed(torch.bfloat16),
        "int8 W8A8 (fbgemm)": fbgemm(),
        "int8 weight-only": weight_only(),
    }
    rows_list = (1, 8, 64, 256)
    print(f"{'kernel':<26}" + "".join(f"{f'{r} rows':>11}" for r in rows_list))
    for name, run in kinds.items():
        cells = []
        for rows in rows_list:
            xs = {i: torch.randn(rows, i) for i in (576, 1536)}
            run(xs)
            t = time.perf_counter()
            for _ in range(5):
                run(xs)
            cells.append(f"{(time.perf_counter() - t) / 5 * 1000:>9.1f}ms")
        print(f"{name:<26}" + "".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if args.kernels:
        kernels()
        return
    llms = {
        name: LLM(num_kv_blocks=320, enable_prefix_caching=False, **kw)
        for name, kw in CONFIGS.items()
    }
    for name, llm in llms.items():
        print(f"{name}: {llm.engine.info.kernel_table.splitlines()[-1].strip()}")
    accuracy(llms)
    step_times(llms)


if __name__ == "__main__":
    main()
