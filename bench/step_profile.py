"""Time (and optionally profile) engine steps in-process on the default model: a prefill of N
prompts, then decode steps of the batch of N, with no HTTP in between.

    python bench/step_profile.py --batch 16 [--prompt-len 256] [--profile]
    python bench/step_profile.py --batch 1 --prompt-len 1500 --prefill-only [--profile]
    python bench/step_profile.py --batch 16 --dtype bfloat16   # default: --dtype auto
    python bench/step_profile.py --batch 16 --quantization int8
    KVSERVE_NO_CPP=1 python bench/step_profile.py --batch 16   # without the C++ ops

Prints the prefill time and the mean decode step (ms, tokens/s); `--profile` adds
torch.profiler's table of the ops where the decode steps spend their time. The figures in the
session notes for single changes (packed weights, C++ decode, fused ops) come from this.
"""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams
from harness.workload import chat_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--no-packed-weights", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (engine --dtype)")
    ap.add_argument("--quantization", default="auto", help="auto | none | int8 (--quantization)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16")
    ap.add_argument("--gguf-int8-activations", default="auto", help="auto | on | off")
    ap.add_argument("--gguf-int8-prefill", default="off", help="auto | on | off")
    a = ap.parse_args()
    # speculation off: a verify step is another step, and drafts would end the requests early
    # (the steps timed after the end are empty)
    llm = LLM(
        num_speculative_tokens=0,
        gguf_int8_activations=a.gguf_int8_activations,
        gguf_int8_prefill=a.gguf_int8_prefill,
        cpu_packed_weights=not a.no_packed_weights,
        enable_prefix_caching=False,
        dtype=a.dtype,
        quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype,
    )
    print(f"dtype {llm.engine.info.dtype} ({llm.engine.info.dtype_reason})")
    print(llm.engine.info.kernel_table.splitlines()[-1].strip())
    for line in llm.engine.info.kernel_table.splitlines():
        for part in line.split("; "):
            if "int8 W8A8" in part or "int8 prefill" in part:
                print(part.strip())
    engine = llm.engine
    n = a.prompt_len
    work = chat_prompts(llm.tokenizer, a.batch, (n, n), (1, 1), seed=3)
    # the step budget prefills about a prompt a step, and every running request decodes in each
    # of those steps: each must outlast the whole prefill to be in the decode batch timed
    tokens = 1 if a.prefill_only else a.steps + 5 + a.batch
    for i, (prompt, _) in enumerate(work):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    from torch.profiler import ProfilerActivity, profile

    prefill_profile = profile(activities=[ProfilerActivity.CPU])
    if a.prefill_only and a.profile:  # the prefill's ops instead of the decode steps'
        prefill_profile.start()
    t, steps = time.perf_counter(), 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
        steps += 1
    dt = time.perf_counter() - t
    total = sum(len(p) for p, _ in work)
    print(f"prefill {a.batch} x {total // a.batch} tokens: {dt:.2f} s in {steps} steps")
    if a.prefill_only:
        if a.profile:
            prefill_profile.stop()
            averages = prefill_profile.key_averages()
            print(averages.table(sort_by="self_cpu_time_total", row_limit=12))
        return
    for _ in range(3):
        engine.step()
    rows = len(engine.scheduler.running)
    assert rows == a.batch, f"{rows} of the {a.batch} requests still decode"
    t = time.perf_counter()
    for _ in range(a.steps - 5):
        engine.step()
    step = (time.perf_counter() - t) / (a.steps - 5)
    print(f"decode step, batch {a.batch}: {step * 1000:.1f} ms = {a.batch / step:.1f} tok/s")
    if a.profile:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
