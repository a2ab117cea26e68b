"""Speculative decoding on the default model, off vs on side by side, over a mixed held-out
workload: free chat (held-out subjects), RAG answers over a provided document, JSON extraction
under a schema, a tool call, editing a given code block, and a multi-turn chat.

For each batch size the two engines run alternately (`--rounds` times, so drift on a shared
machine hits both), greedy (and `--temperature` if given); printed per category at batch 1 and
for the whole mix at every batch size: output tokens/s off and on, their ratio, tokens per
verification round, the share of drafts each source (grammar, suffix, eagle) had kept, and
whether greedy output was identical with speculation on.

    python bench/speculative.py                       # --method auto, k <= 8, batch 1 and 8
    python bench/speculative.py --method eagle --k 4  # round 2's EAGLE-only figure
    python bench/speculative.py --batch-sizes 1,8,32,64 --pin-k
    python bench/speculative.py --base no-corpus      # what corpus drafts add to the rest
    python bench/speculative.py --temperatures 0,0.7  # sampled rows drafted (unless --seeded)
    python bench/speculative.py --method eagle --base shipped --speculative-model DIR
                                                      # a retrained head against the shipped one
    python bench/speculative.py --base shipped --speculative-corpus DIR   # another corpus
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from engine import LLM, SamplingParams
from engine.core.sampling_params import GrammarSpec
from models.eagle.prompts import heldout_prompts

DOCUMENT = (
    "The Lindqvist Observatory stands on a granite ridge 1,840 metres above the town of "
    "Storvik. It was opened in 1962 by the Nordic Astronomy Council and houses a 2.4-metre "
    "reflecting telescope, the largest in the region. The observatory is open to visitors "
    "from May to September, every day except Monday, from 10 am to 6 pm. Guided night tours "
    "run on Fridays and cost 180 crowns for adults and 90 crowns for children. The road to "
    "the ridge closes when snow falls, usually from late October."
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "occupation", "hobbies"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_flights"]},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
PEOPLE = [
    "Maria Lopez is a 34-year-old nurse from Valencia who loves hiking, chess and baking.",
    "Tom Becker, 52, drives a tram in Leipzig; in his spare time he fishes and paints.",
]


def workload(num_chat: int) -> list[tuple[str, list[dict], GrammarSpec | None]]:
    """(category, conversation, grammar) items."""
    items: list[tuple[str, list[dict], GrammarSpec | None]] = []
    for p in heldout_prompts(num_chat):
        items.append(("chat", [{"role": "user", "content": p}], None))
    for q in (
        "When is the observatory open, and what do night tours cost?",
        "Who opened the observatory, when, and what telescope does it house?",
    ):
        doc = f"Document:\n{DOCUMENT}\n\nAnswer from the document, quoting it: {q}"
        items.append(("rag", [{"role": "user", "content": doc}], None))
    person = GrammarSpec("json_schema", json.dumps(PERSON))
    for text in PEOPLE:
        ask = f"Extract the person as JSON (name, age, city, occupation, hobbies): {text}"
        items.append(("json", [{"role": "user", "content": ask}], person))
    call = GrammarSpec("json_schema", json.dumps(CALL))
    for city in ("Lisbon", "Osaka"):
        ask = f"Call get_weather for {city} in Celsius. Reply with the call as JSON only."
        items.append(("tools", [{"role": "user", "content": ask}], call))
    for rename in ("items -> products", "tax_rate -> vat"):
        ask = f"Rename {rename} in this code and print the whole code:\n\n{CODE}"
        items.append(("edit", [{"role": "user", "content": ask}], None))
    chat = [
        {"role": "user", "content": "Give me three tips for growing tomatoes on a balcony."},
        {
            "role": "assistant",
            "content": "1. Use a large pot with drainage holes.\n2. Put it "
            "where it gets at least six hours of sun.\n3. Water deeply at the base every morning.",
        },
        {"role": "user", "content": "Repeat the three tips, adding one sentence to each."},
    ]
    items.append(("multi-turn", chat, None))
    return items


def prompts_of(llm: LLM, items: list) -> list[list[int]]:
    tok = llm.tokenizer
    assert tok is not None
    return [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for _, c, _ in items]


def run(llm: LLM, prompts, params, batch: int) -> tuple[list[list[int]], float]:
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += [
            r.outputs[0].token_ids
            for r in llm.generate(prompts[i : i + batch], params[i : i + batch])
        ]
    return outs, time.perf_counter() - start


def source_counts(llm: LLM) -> dict[str, tuple[int, int, int]]:
    drafter = llm.engine.drafter
    if drafter is None:
        return {}
    return {
        name: (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
        for name, s in drafter.stats.items()
    }


def compare(base: LLM, spec: LLM, items, temperature: float, batch: int, args) -> dict:
    prompts = prompts_of(base, items)
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=args.max_tokens,
            grammar=g,
            seed=i if args.seeded or temperature == 0 else None,
        )
        for i, (_, _, g) in enumerate(items)
    ]
    before = source_counts(spec)
    times = {"base": 0.0, "spec": 0.0}
    outs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, llm in (("base", base), ("spec", spec)):
            outs[name], dt = run(llm, prompts, params, batch)
            times[name] += dt
    after = source_counts(spec)
    delta = {s: tuple(a - b for a, b in zip(after[s], before.get(s, (0, 0, 0)))) for s in after}
    tokens = sum(len(o) for o in outs["spec"]) * args.rounds
    base_tokens = sum(len(o) for o in outs["base"]) * args.rounds
    rounds = sum(d[0] for d in delta.values())
    accepted = sum(d[2] for d in delta.values())
    return {
        "raw": (base_tokens, times["base"], tokens, times["spec"], rounds, accepted),
        "base": base_tokens / times["base"],
        "spec": tokens / times["spec"],
        "accept_len": 1 + accepted / max(1, rounds),
        "kept": {s: f"{d[2]}/{d[1]}" for s, d in delta.items() if d[1]},
        "identical": outs["base"] == outs["spec"],
    }


def line(label: str, r: dict, temperature: float) -> str:
    same = ("same" if r["identical"] else "DIFFERENT") if temperature == 0 else "-"
    kept = " ".join(f"{s}:{v}" for s, v in r["kept"].items())
    return (
        f"{label:<14}{r['base']:>9.1f}{r['spec']:>9.1f}{r['spec'] / r['base']:>7.2f}x"
        f"{r['accept_len']:>7.2f}  {same:<9} {kept}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--num-chat", type=int, default=4, help="free-chat prompts in the mix")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--temperatures", default="0")
    ap.add_argument(
        "--seeded",
        action="store_true",
        help="seed sampled requests (then not drafted for: a seeded request's tokens depend on "
        "its seed alone); default: unseeded, so sampled rows are drafted and verified",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-verify-rows", type=int, default=16)
    ap.add_argument(
        "--cost-model",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="adaptive k by measured costs (else the row cap alone)",
    )
    ap.add_argument("--pin-k", action="store_true", help="k drafts at every batch size")
    ap.add_argument(
        "--base",
        choices=("off", "no-corpus", "shipped"),
        default="off",
        help="the engine compared against: speculation off, on without corpus drafts, or on "
        "with the shipped head and corpus (against --speculative-model's / -corpus's)",
    )
    ap.add_argument("--speculative-model", default="", help="the EAGLE head of the 'on' engine")
    ap.add_argument("--speculative-corpus", default="", help="the answer corpus of the 'on' one")
    ap.add_argument("--categories", default="", help="comma list (default: all)")
    args = ap.parse_args()
    items = workload(args.num_chat)
    if args.categories:
        items = [item for item in items if item[0] in args.categories.split(",")]
    on = dict(
        dtype=args.dtype,
        speculative_method=args.method,
        num_speculative_tokens=args.k,
        spec_max_verify_rows=1 << 16 if args.pin_k else args.max_verify_rows,
        spec_cost_model=args.cost_model and not args.pin_k,
    )
    if args.base == "off":
        base = LLM(dtype=args.dtype, num_speculative_tokens=0)
    elif args.base == "no-corpus":
        base = LLM(**on, speculative_corpus="off")
    else:
        base = LLM(**on)
    spec = LLM(
        **on, speculative_model=args.speculative_model, speculative_corpus=args.speculative_corpus
    )
    # warm-up: the first constrained request builds the grammar compiler's tables
    warm = prompts_of(base, items)
    warm_params = [SamplingParams(max_tokens=4, grammar=g) for _, _, g in items]
    for llm in (base, spec):
        llm.generate(warm, warm_params)
    print(f"method {args.method}, k <= {args.k}, {len(items)} prompts, {args.max_tokens} tokens")
    print(f"{'':<14}{'off t/s':>9}{'on t/s':>9}{'ratio':>8}{'t/rnd':>7}  greedy    kept")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        print(f"-- temperature {temperature}")
        by_category = defaultdict(list)
        for item in items:
            by_category[item[0]].append(item)
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        parts = []
        for category, group in by_category.items() if 1 in sizes else ():
            parts.append(compare(base, spec, group, temperature, 1, args))
            print(line(f"b1 {category}", parts[-1], temperature))
        if parts:
            bt, btime, st, stime, rounds, accepted = (
                sum(x) for x in zip(*(p["raw"] for p in parts))
            )
            mix1 = {
                "base": bt / btime,
                "spec": st / stime,
                "kept": {},
                "accept_len": 1 + accepted / max(1, rounds),
                "identical": all(p["identical"] for p in parts),
            }
            print(line("b1 mix", mix1, temperature))
        for batch in (b for b in sizes if b > 1):
            mix = items * max(1, batch // len(items))
            r = compare(base, spec, mix, temperature, batch, args)
            print(line(f"b{batch} mix", r, temperature))


if __name__ == "__main__":
    main()
