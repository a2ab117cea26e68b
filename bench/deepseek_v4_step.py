"""Decode step time of the tiny DeepSeek V4 (bench/deepseek_v4_kv.py's TINY, random weights)
against a dense Llama of the same hidden size, layers, heads and head_dim (one KV head), at batch
1 and 16 with 8k tokens of context each, in the same run; and where the V4 step's time goes.

A step's time: the median of STEPS `engine.step()` calls once every request of the batch has
its first token (all rows decode). `python -m bench.deepseek_v4_kv --time` runs it."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams

CONTEXT, STEPS = 8 << 10, 6


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


def step_ms(llm: LLM, batch: int, context: int, profiled: bool = False) -> tuple[float, str]:
    """Median time of STEPS engine steps once `batch` requests of `context` prompt tokens are
    all decoding; with `profiled`, the torch profiler's top ops over those steps."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 3, ignore_eos=True)
    for s in range(batch):
        prompt = [(i * 37 + s * 101) % 500 + 3 for i in range(context)]
        engine.add_request(f"{batch}-{s}-{time.monotonic_ns()}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # the prompts, chunk by chunk
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    engine.step()  # a first decode step
    times, table = [], ""
    with profile(activities=[ProfilerActivity.CPU]) if profiled else _Nothing() as prof:
        for _ in range(STEPS):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    if profiled:
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    while engine.has_unfinished():
        engine.step()
    return 1000 * statistics.median(times), table


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def time_steps(context: int = CONTEXT, batches: tuple[int, ...] = (1, 16)) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engines = {
            kind: LLM(write(Path(tmp) / kind, kind), dtype="float32", num_kv_blocks=2304,
                      block_size=64, max_num_batched_tokens=1024, num_speculative_tokens=0,
                      max_num_seqs=16, target_step_ms=-1, cpu_packed_weights=False)
            for kind in ("v4", "dense")
        }  # fmt: skip
        threads = torch.get_num_threads()
        print(f"\ndecode step at {context} tokens of context, float32, {threads} threads "
              f"(median of {STEPS} steps)")  # fmt: skip
        table = ""
        for batch in batches:
            ms = {}
            for kind, llm in engines.items():
                ms[kind], prof = step_ms(llm, batch, context, kind == "v4" and batch == batches[-1])
                table = prof or table
            print(f"batch {batch:2d}: v4 {ms['v4']:7.2f} ms, dense {ms['dense']:7.2f} ms "
                  f"({ms['v4'] / ms['dense']:.2f}x)")  # fmt: skip
        print(f"\nwhere a v4 batch-{batches[-1]} decode step's time goes:\n{table}")
