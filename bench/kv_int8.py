"""The int8 KV cache against the float caches on the default model, in one process: accuracy
(teacher-forced logits over ~1,500 tokens of real text, each cache against a float32 cache:
top-1 agreement, logit cosine, the text's mean negative log-likelihood), capacity (blocks in the
same KV memory) and the decode step at batch 64 (contexts of ~260 and ~1,000 tokens), the
caches' steps interleaved.

    python bench/kv_int8.py [--steps 12] [--batch 64]

The text is the docstrings of a few standard-library modules (English prose and code, the same
on every machine, none of it in the held-out set the startup judge reads).
"""

from __future__ import annotations

import inspect
import time

import torch

from bench import cli
from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from harness.workload import chat_prompts

MODULES = ("json", "argparse", "collections", "functools", "pathlib", "subprocess")


def text_ids(llm: LLM, limit: int) -> list[int]:
    text = "\n\n".join(inspect.getdoc(__import__(m)) or "" for m in MODULES)
    return llm.tokenizer.encode(text, add_special_tokens=False)[:limit]


def accuracy(dtype: str, tokens: int) -> None:
    caches = ("float32", "bfloat16", "int8") if dtype == "float32" else ("auto", "int8")
    llms = {kv: LLM(dtype=dtype, kv_cache_dtype=kv, num_speculative_tokens=0) for kv in caches}
    ids = text_ids(next(iter(llms.values())), tokens)
    logits = {kv: score_prompt(llm.engine, ids) for kv, llm in llms.items()}
    ref_name = caches[0]
    ref = logits[ref_name]
    target = torch.tensor(ids[1:])
    print(f"accuracy, {dtype} activations, {len(ids)} tokens, against a {ref_name} cache:")
    for kv, got in logits.items():
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1).mean().item()
        nll = torch.nn.functional.cross_entropy(got[:-1], target).item()
        print(f"  {kv:>9}: top-1 {top1:.4f}, cosine {cos:.5f}, text NLL {nll:.4f}")
    for llm in llms.values():
        llm.engine.shutdown()


def decode_steps(batch: int, context: int, steps: int) -> None:
    # the first rows decode while the last prefill (chunked): enough tokens to outlast that
    max_tokens = batch * context // 256 + 2 * steps + 8
    blocks = batch * -(-(context + max_tokens + 16) // 64) + 8  # every row at once, both caches
    llms = {
        kv: LLM(
            kv_cache_dtype=kv,
            num_speculative_tokens=0,
            enable_prefix_caching=False,
            num_kv_blocks=blocks,
            block_size=64,
        )
        for kv in ("auto", "int8")
    }
    times: dict[str, list[float]] = {kv: [] for kv in llms}
    for kv, llm in llms.items():
        work = chat_prompts(llm.tokenizer, batch, (context, context), (1, 1), seed=3)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, (prompt, _) in enumerate(work):
            llm.engine.add_request(f"{kv}{i}", prompt, params)
        sched = llm.engine.scheduler
        while sched.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
        ):
            llm.engine.step()
        for _ in range(2):
            llm.engine.step()
    rows = {len(llm.engine.scheduler.running) for llm in llms.values()}
    assert rows == {batch}, f"{rows} rows running, not {batch}: the pools are too small"
    for _ in range(steps):  # interleaved: the machine's noise lands on both
        for kv, llm in llms.items():
            t = time.perf_counter()
            llm.engine.step()
            times[kv].append(time.perf_counter() - t)
    med = {kv: sorted(ts)[len(ts) // 2] * 1000 for kv, ts in times.items()}
    served = str(llms["auto"].engine.runner.backend.kv_caches[0].dtype).removeprefix("torch.")
    block = {kv: llm.engine.info.kv_block_bytes for kv, llm in llms.items()}
    print(
        f"decode step, batch {batch}, ~{context}-token contexts (median of {steps}): "
        f"{served} cache {med['auto']:.1f} ms, int8 {med['int8']:.1f} ms "
        f"({med['auto'] / med['int8']:.2f}x); a block {block['auto']} vs {block['int8']} B"
    )
    for llm in llms.values():
        llm.engine.shutdown()


def main() -> None:
    a = cli.parser(__doc__, steps=12, batch=64, tokens=1500).parse_args()
    accuracy("float32", a.tokens)
    accuracy("auto", a.tokens)
    for context in (260, 1000):
        decode_steps(a.batch, context, a.steps)


if __name__ == "__main__":
    main()
