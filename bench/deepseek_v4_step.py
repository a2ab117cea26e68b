"""Decode step time of the tiny DeepSeek V4 (bench/deepseek_v4_kv.py's TINY, random weights)
against a dense Llama of the same hidden size, layers, heads and head_dim (one KV head), at batch
1 and 16 with 8k tokens of context each, in the same run; and where the V4 step's time goes.

The V4 engine's decode step is timed in two forms on the same decoding batch, steps of each in
turn: its PyTorch ops alone (the reference) and as its startup measurement chose (the C++ ops of
kernels/deepseek_v4.cpp where they were faster; the banner's "decode step" line).

A step's time: the median of STEPS `engine.step()` calls of a form once every request of the
batch decodes (they ask for more tokens than the prefills of the batch take steps, and are
aborted after), wall clock and the process's CPU time (which a shared machine's time-slicing
does not inflate; with one torch thread the two agree on an idle machine).
`python -m bench.deepseek_v4_kv --time` runs it."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
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
            vocab_size=TINY["vocab_size"],
            hidden_size=TINY["hidden_size"],
            num_hidden_layers=TINY["num_hidden_layers"],
            head_dim=TINY["head_dim"],
            num_attention_heads=TINY["num_attention_heads"],
            num_key_value_heads=1,
            intermediate_size=TINY["moe_intermediate_size"] * 3,
            max_position_embeddings=1 << 16,
        )
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    model.float().save_pretrained(out)
    return str(out)


def step_ms(
    llm: LLM, batch: int, context: int, forms: dict[str, Callable[[], None]], profiled: bool = False
) -> tuple[dict[str, float], dict[str, str]]:
    """Median time of STEPS engine steps of each form (a setter called before its steps, the
    forms in turn, twice) once `batch` requests of `context` prompt tokens all decode; with
    `profiled`, each form's top ops by self CPU time over its steps."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=context, ignore_eos=True)
    for s in range(batch):
        prompt = [(i * 37 + s * 101) % 500 + 3 for i in range(context)]
        engine.add_request(f"{batch}-{s}-{time.monotonic_ns()}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:  # the prompts, chunk by chunk
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    times: dict[str, list[float]] = {name: [] for name in forms}
    cpu: dict[str, list[float]] = {name: [] for name in forms}
    tables = {}
    # rounds 0 and 2 timed, the forms in turn; round 1 (with `profiled`) under the profiler,
    # whose cost a step grows with its op count, so untimed
    for round_ in (0, 1, 2) if profiled else (0, 2):
        for name, use in forms.items():
            use()
            engine.step()  # a first step of this form
            with profile(activities=[ProfilerActivity.CPU]) if round_ == 1 else _Nothing() as prof:
                for _ in range(STEPS // 2):
                    start, cpu_start = time.perf_counter(), time.process_time()
                    outs = engine.step()
                    if round_ != 1:
                        times[name].append(time.perf_counter() - start)
                        cpu[name].append(time.process_time() - cpu_start)
                    if sum(1 for out in outs if out.new_token_ids) != batch:
                        raise RuntimeError(f"a step decoded {len(outs)} rows, not {batch}")
            if round_ == 1:  # the op count: what a loaded machine cannot skew
                events = prof.key_averages()
                calls = sum(e.count for e in events) / (STEPS // 2)
                tables[name] = (
                    f"{calls:.0f} op calls a step (profiler events, nested ones "
                    f"included)\n" + events.table(sort_by="self_cpu_time_total", row_limit=12)
                )
    engine.abort_all()
    for name in forms:  # the process's CPU time: what time-slicing on a shared machine spares
        tables[f"{name} cpu"] = f"{1000 * statistics.median(cpu[name]):.2f}"
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}, tables


FLAGS = ("fused", "fused_rope")  # the V4 modules' C++ forms (engine/build/deepseek_v4_choice.py)


def set_fused(model: torch.nn.Module, chosen: dict[tuple, bool] | None) -> None:
    """Every V4 module's C++ forms off (None), or back to what the startup measurement chose."""
    for module in model.modules():
        for flag in FLAGS:
            if hasattr(module, flag):
                setattr(module, flag, chosen[module, flag] if chosen is not None else False)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def time_steps(context: int = CONTEXT, batches: tuple[int, ...] = (1, 16)) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engines = {
            kind: LLM(
                write(Path(tmp) / kind, kind),
                dtype="float32",
                num_kv_blocks=2304,
                block_size=64,
                max_num_batched_tokens=1024,
                num_speculative_tokens=0,
                max_num_seqs=16,
                target_step_ms=-1,
                cpu_packed_weights=False,
            )
            for kind in ("v4", "dense")
        }
        model = engines["v4"].engine.model
        chosen = {(m, f): getattr(m, f) for m in model.modules() for f in FLAGS if hasattr(m, f)}
        v4_forms = {
            "v4 PyTorch": lambda: set_fused(model, None),
            "v4 chosen": lambda: set_fused(model, chosen),
        }
        threads = torch.get_num_threads()
        line = next(
            x for x in engines["v4"].engine.info.kernel_table.splitlines() if "decode step:" in x
        )
        print(f"\nv4 startup choice: {line.strip()}")
        print(
            f"\ndecode step at {context} tokens of context, float32, {threads} threads "
            f"(median of {STEPS} steps a form)"
        )
        for batch in batches:
            v4, tables = step_ms(engines["v4"], batch, context, v4_forms, profiled=True)
            dense, dense_tables = step_ms(
                engines["dense"], batch, context, {"dense": lambda: None}, profiled=True
            )
            d = dense["dense"]
            print(
                f"batch {batch:2d}: dense {d:7.2f} ms; v4 PyTorch {v4['v4 PyTorch']:7.2f} ms "
                f"({v4['v4 PyTorch'] / d:.2f}x), v4 as chosen {v4['v4 chosen']:7.2f} ms "
                f"({v4['v4 chosen'] / d:.2f}x)"
            )
            print(f"dense: {dense_tables['dense'].splitlines()[0]}")
            cpu = {name: float(tables.pop(f"{name} cpu")) for name in v4_forms}
            dense_cpu = float(dense_tables.pop("dense cpu"))
            torch_ms, chosen_ms = cpu["v4 PyTorch"], cpu["v4 chosen"]
            print(
                f"  CPU time a step: dense {dense_cpu:.2f} ms; v4 PyTorch {torch_ms:.2f} ms "
                f"({torch_ms / dense_cpu:.2f}x), v4 as chosen {chosen_ms:.2f} ms "
                f"({chosen_ms / dense_cpu:.2f}x)"
            )
            for name, table in tables.items():
                print(f"\nwhere a {name} batch-{batch} decode step's time goes:\n{table}")
