"""Decode step time of the tiny DeepSeek V4 (bench/deepseek_v4_kv.py's TINY, random weights)
against a dense Llama of the same hidden size, layers, heads and head_dim (one KV head), at batch
1 and 16 with 8k tokens of context each, in the same run; and where the V4 step's time goes.

A step's time: the prompts are prefilled once (their blocks stay cached), then
generate(max_tokens=1 + K) against generate(max_tokens=1), both prefix hits: the difference over K
is K decode steps. `python -m bench.deepseek_v4_kv --time` runs it."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams

CONTEXT, STEPS, ROUNDS = 8 << 10, 4, 2


def write(out: Path, kind: str) -> str:
    import transformers

    from bench.deepseek_v4_kv import TINY

    torch.manual_seed(0)
    if kind == "v4":
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**TINY))
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=TINY["vocab_size"], hidden_size=TINY["hidden_size"],
            num_hidden_layers=TINY["num_hidden_layers"], head_dim=TINY["head_dim"],
            num_attention_heads=TINY["num_attention_heads"], num_key_value_heads=1,
            intermediate_size=TINY["moe_intermediate_size"] * 3, max_position_embeddings=1 << 16,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    model.float().save_pretrained(out)
    return str(out)


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def step_ms(llm: LLM, batch: int) -> float:
    prompts = [[(i * 37 + s * 101) % 500 + 3 for i in range(CONTEXT)] for s in range(batch)]
    timed(llm, prompts, 1)  # prefill: the blocks stay cached
    diffs = [(timed(llm, prompts, 1 + STEPS) - timed(llm, prompts, 1)) / STEPS
             for _ in range(ROUNDS)]  # fmt: skip
    return 1000 * statistics.median(diffs)


def profile(llm: LLM, batch: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    prompts = [[(i * 37 + s * 101) % 500 + 3 for i in range(CONTEXT)] for s in range(batch)]
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        timed(llm, prompts, 1 + STEPS)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def time_steps() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engines = {
            kind: LLM(write(Path(tmp) / kind, kind), dtype="float32", num_kv_blocks=2304,
                      block_size=64, max_num_batched_tokens=1024, num_speculative_tokens=0,
                      max_num_seqs=16, target_step_ms=-1, cpu_packed_weights=False)
            for kind in ("v4", "dense")
        }  # fmt: skip
        threads = torch.get_num_threads()
        print(f"\ndecode step at {CONTEXT} tokens of context, float32, {threads} threads "
              f"(median of {ROUNDS}, {STEPS} steps each)")  # fmt: skip
        for batch in (1, 16):
            ms = {kind: step_ms(llm, batch) for kind, llm in engines.items()}
            print(f"batch {batch:2d}: v4 {ms['v4']:7.2f} ms, dense {ms['dense']:7.2f} ms "
                  f"({ms['v4'] / ms['dense']:.2f}x)")  # fmt: skip
        print("\nwhere a v4 batch-16 run's time goes (prefix-hit prefill + decode steps):")
        print(profile(engines["v4"], 16))
