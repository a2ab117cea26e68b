"""Constrained decoding's cost, in-process on the default model (no HTTP), side by side in one
run: N concurrent requests all free vs half constrained by a JSON schema, output tok/s and the
ratio; the grammar mask time per engine step (the bitmask fill) and grammar compile time p50/p99
over typical schemas; and EAGLE acceptance with and without a schema (batch 1).

    python bench/structured.py [--batch 64] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import json
import statistics
import time

from bench import cli
from engine import LLM, SamplingParams
from engine.core.sampling_params import GrammarSpec
from harness.workload import chat_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "steps": {"type": "array", "items": {"type": "string"}},
        "done": {"type": "boolean"},
    },
    "required": ["title", "steps", "done"],
}
COMPILE_SCHEMAS = [
    {"type": "object", "properties": {f"f{i}": {"type": t} for i, t in enumerate(types)}}
    for types in (
        ["string", "integer", "boolean"],
        ["number", "string", "string", "integer", "null"],
        ["array", "object", "string"],
    )
] + [
    SCHEMA,
    {"type": "array", "items": SCHEMA, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "e": {"enum": ["a", "b", "c"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["e", "n"],
    },
]


class MaskTimer:
    def __init__(self, llm: LLM) -> None:
        self.times: list[float] = []
        structured = llm.engine.structured
        assert structured is not None, "this model has no structured outputs"
        original = structured.step_mask

        def timed(scheduled):
            t = time.perf_counter()
            mask = original(scheduled)
            self.times.append(time.perf_counter() - t)
            return mask

        structured.step_mask = timed  # type: ignore[method-assign]


def run(llm: LLM, prompts: list[list[int]], constrained: int, tokens: int) -> tuple[float, int]:
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = [
        SamplingParams(
            temperature=0.7,
            seed=i,
            max_tokens=tokens,
            ignore_eos=True,
            grammar=grammar if i < constrained else None,
        )
        for i in range(len(prompts))
    ]
    t = time.perf_counter()
    out = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    generated = sum(len(r.outputs[0].token_ids) for r in out)
    return generated / wall, generated


def main() -> None:
    a = cli.parser(__doc__, batch=64, tokens=64, rounds=2).parse_args()
    llm = LLM(max_num_seqs=a.batch)
    timer = MaskTimer(llm)
    work = chat_prompts(llm.tokenizer, a.batch, (200, 260), (1, 1), seed=5)
    prompts = [p for p, _ in work]
    free, mixed = [], []
    for r in range(a.rounds):
        for name in ["free", "mixed"] if r % 2 == 0 else ["mixed", "free"]:
            llm.engine.reset_prefix_cache()
            rate, n = run(llm, prompts, a.batch // 2 if name == "mixed" else 0, a.tokens)
            (free if name == "free" else mixed).append(rate)
            print(f"round {r + 1} {name:5s}: {rate:.1f} output tok/s ({n} tokens)", flush=True)
    ratio = statistics.mean(mixed) / statistics.mean(free)
    print(f"\nmixed (half constrained) / all free output tok/s: {ratio:.3f}")
    ms = sorted(t * 1000 for t in timer.times)
    print(
        f"grammar mask per step ({a.batch // 2} constrained rows): p50 {ms[len(ms) // 2]:.2f} ms,"
        f" p99 {ms[int(len(ms) * 0.99)]:.2f} ms over {len(ms)} steps"
    )
    structured = llm.engine.structured
    compile_ms = []
    for i, schema in enumerate(COMPILE_SCHEMAS * 3):
        # a property of its own: every schema compiles cold (the cache is keyed by grammar)
        fresh = {**schema, "properties": {**schema.get("properties", {}), f"run{i}": {}}}
        spec = GrammarSpec("json_schema", json.dumps(fresh))
        t = time.perf_counter()
        structured.compile(spec)
        compile_ms.append((time.perf_counter() - t) * 1000)
    compile_ms.sort()
    p50 = compile_ms[len(compile_ms) // 2]
    print(f"grammar compile (cold, {len(compile_ms)} schemas): p50 {p50:.1f} ms, ", end="")
    print(f"p99 {compile_ms[-1]:.1f} ms")
    spec_llm = LLM(num_speculative_tokens=4, speculative_method="eagle")
    for label, grammar in (
        ("free", None),
        ("schema", GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ):
        before = (
            spec_llm.engine.drafter.stats["eagle"].num_drafts,
            spec_llm.engine.drafter.stats["eagle"].num_accepted_tokens,
        )
        params = SamplingParams(temperature=0, max_tokens=96, grammar=grammar)
        for p in prompts[:6]:
            spec_llm.generate([p], params)
        st = spec_llm.engine.drafter.stats["eagle"]
        drafts, accepted = st.num_drafts - before[0], st.num_accepted_tokens - before[1]
        length = 1 + accepted / max(drafts, 1)
        print(f"EAGLE k=4, batch 1, {label}: mean acceptance length {length:.2f}")


if __name__ == "__main__":
    main()
