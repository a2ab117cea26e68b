"""Offline throughput: kvserve's `LLM.generate` vs transformers' batched `generate`, same model,
same 64 chat prompts (32-512 prompt tokens, 32-256 new tokens, seeded), in one run.

    python bench/offline_throughput.py [--num-prompts 64] [--skip-transformers]

Prints output tokens/s for both, their ratio, and the fraction of this machine's float32 matmul
rate kvserve reached (model FLOPs per token x tokens/s over measured GFLOP/s)."""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.roofline import matmul_gflops
from engine import LLM, SamplingParams
from harness.workload import chat_prompts


def run_kvserve(llm: LLM, work) -> tuple[int, float]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    t = time.perf_counter()
    results = llm.generate([p for p, _ in work], params)
    dt = time.perf_counter() - t
    return sum(len(r.outputs[0].token_ids) for r in results), dt


def run_transformers(path: str, work, batch: int) -> tuple[int, int, float]:
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(path)
    kwargs = {"gguf_file": f} if f.endswith(".gguf") else {}
    model = AutoModelForCausalLM.from_pretrained(
        d if kwargs else path, dtype=torch.float32, **kwargs
    )
    model.eval()
    # greedy, no EOS, padded with 0: every request makes its whole answer (as kvserve's do)
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    useful = produced = 0
    t = time.perf_counter()
    for start in range(0, len(work), batch):
        chunk = work[start : start + batch]
        longest = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for i, (p, _) in enumerate(chunk):  # left padding
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        new = max(m for _, m in chunk)
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new
            )
        useful += sum(m for _, m in chunk)
        produced += new * len(chunk)
    return useful, produced, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = ap.parse_args()

    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    spec = llm.engine.spec
    work = chat_prompts(llm.tokenizer, args.num_prompts)
    prompt_tokens = sum(len(p) for p, _ in work)
    print(
        f"workload: {len(work)} prompts, {prompt_tokens} prompt tokens, "
        f"{sum(m for _, m in work)} output tokens"
    )

    gflops = matmul_gflops(spec.hidden_size, spec.layers[0].intermediate_size, 256)
    ours_tokens, ours_dt = run_kvserve(llm, work)
    ours_tps = ours_tokens / ours_dt
    flops = spec.flops_per_token()
    achieved = (ours_tokens + prompt_tokens) * flops / ours_dt / 1e9
    print(
        f"kvserve:      {ours_tokens} tokens in {ours_dt:.1f} s = {ours_tps:.1f} output tok/s "
        f"({achieved:.1f} GFLOP/s incl. prefill = {achieved / gflops:.0%} of the "
        f"{gflops:.0f} GFLOP/s float32 matmul rate measured now)"
    )
    if args.skip_transformers:
        return
    del llm
    useful, produced, hf_dt = run_transformers(
        args.model or __import__("models.loader").loader.default_model_path(), work, args.hf_batch
    )
    print(
        f"transformers: {useful} useful tokens ({produced} generated incl. padding waste) in "
        f"{hf_dt:.1f} s = {useful / hf_dt:.1f} useful tok/s ({produced / hf_dt:.1f} raw)"
    )
    print(
        f"ratio kvserve / transformers: {ours_tps / (useful / hf_dt):.2f}x "
        f"(vs raw: {ours_tps / (produced / hf_dt):.2f}x)"
    )


if __name__ == "__main__":
    main()
