"""Constrained decoding in the engine, on a tiny random model (whose unconstrained output is
noise, so every well-formed output is the grammar's doing): generated JSON schemas always give
outputs that validate, with speculation on, with n = 2, under chunked prefill, prefix hits and
preemption; speculation stays lossless under a grammar; sampling draws from the masked
distribution."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.core.sampling_params import GrammarSpec, ParamError
from engine.core.scoring import score_prompt
from tests.test_speculative import PIN_K, write_eagle1

PROMPTS = [[5, 6, 7, 8, 9], [30, 31, 32] * 7, [100, 7, 200, 9, 11, 12]]

# bounded leaves, so a random model's output ends well inside max_tokens
LEAF = st.sampled_from(
    [
        {"type": "boolean"},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "string", "maxLength": 4},
        {"type": "string", "enum": ["red", "green", "blue"]},
        {"type": "null"},
        {"const": "fixed"},
    ]
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict, required_mask: list[bool]) -> dict:
        names = list(props)
        return {
            "type": "object",
            "properties": props,
            "required": [n for n, r in zip(names, required_mask) if r],
            "additionalProperties": False,
        }

    return st.dictionaries(
        st.from_regex(r"[a-z]{1,4}", fullmatch=True), children, min_size=1, max_size=3
    ).flatmap(
        lambda p: st.lists(st.booleans(), min_size=len(p), max_size=len(p)).map(
            lambda mask, p=p: build(p, mask)
        )
    )


SCHEMAS = st.recursive(
    LEAF,
    lambda inner: (
        _object(inner)
        | st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2}, inner)
    ),
    max_leaves=5,
).map(
    lambda s: (
        s
        if s.get("type") == "object"
        else {"type": "object", "properties": {"v": s}, "required": ["v"]}
    )
)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def spec(llama_dir, tmp_path_factory) -> LLM:
    head = write_eagle1(tmp_path_factory.mktemp("head") / "h", identity=False)
    opts = {"num_kv_blocks": 256, "block_size": 4, "speculative_method": "eagle", **PIN_K}
    return LLM(str(llama_dir), speculative_model=str(head), num_speculative_tokens=3, **opts)


def constrained(schema: dict, **kw) -> SamplingParams:
    spec = GrammarSpec("json_schema", json.dumps(schema))
    return SamplingParams(grammar=spec, **{"temperature": 0.8, "max_tokens": 200, **kw})


def check_outputs(results, schema: dict) -> None:
    finished = 0
    for r in results:
        for out in r.outputs:
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), schema)
                finished += 1
    assert finished >= len(results) - 1  # bounded schemas end well within max_tokens


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 1000))
@pytest.mark.slow
def test_generated_schemas_always_validate(llm, spec, schema, seed) -> None:
    params = [constrained(schema, seed=seed + i) for i in range(len(PROMPTS))]
    check_outputs(llm.generate(PROMPTS, params), schema)
    check_outputs(spec.generate(PROMPTS, params), schema)  # speculation on
    n2 = [constrained(schema, seed=seed), constrained(schema, seed=seed + 1)]  # n = 2
    check_outputs(llm.generate([PROMPTS[0], PROMPTS[0]], n2), schema)
    assert llm.engine.kv.pool.num_free_blocks == 256


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "ok"],
    "additionalProperties": False,
}


def test_speculation_is_lossless_under_a_grammar(llm, spec) -> None:
    greedy = constrained(SCHEMA, temperature=0.0)
    plain = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, [greedy] * 3)]
    drafted = [r.outputs[0].token_ids for r in spec.generate(PROMPTS, [greedy] * 3)]
    assert drafted == plain
    assert spec.engine.drafter.stats["eagle"].num_drafts > 0


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_batched_tokens": 6},  # chunked prefill
        {"num_kv_blocks": 40, "preemption_mode": "recompute"},
        {"num_kv_blocks": 40, "preemption_mode": "swap", "host_bytes": "64MiB"},
    ],
)
def test_grammar_survives_chunking_prefix_hits_and_preemption(llama_dir, llm, kw) -> None:
    greedy = constrained(SCHEMA, temperature=0.0, max_tokens=80)
    prompts = [p + [40 + i] for i in range(4) for p in PROMPTS]  # shared prefixes: hits
    want = [r.outputs[0].token_ids for r in llm.generate(prompts, [greedy] * len(prompts))]
    other = LLM(str(llama_dir), **{"num_kv_blocks": 256, "block_size": 4, **kw})
    results = other.generate(prompts, [greedy] * len(prompts))
    assert [r.outputs[0].token_ids for r in results] == want
    check_outputs(results, SCHEMA)
    if "num_kv_blocks" in kw:
        assert other.engine.scheduler.num_preemptions > 0
    assert other.engine.kv.prefix_hits > 0


def test_seeded_constrained_sampling_is_reproducible(llm) -> None:
    params = [constrained(SCHEMA, seed=7, logprobs=2)] * 2
    a, b = llm.generate(PROMPTS[:2], params)
    c = llm.generate(PROMPTS[:1], params[:1])[0]
    assert a.outputs[0].token_ids == c.outputs[0].token_ids
    assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids)


def test_sampling_draws_from_the_masked_distribution(llm) -> None:
    """A choice between two one-token strings: the frequencies follow the model's own
    probabilities renormalised over the two (chi-square, 600 draws)."""
    tok = llm.tokenizer
    words = ["a", "b"]
    ids = [tok.encode(w) for w in words]
    assert all(len(i) == 1 for i in ids)
    prompt = PROMPTS[2]
    logits = score_prompt(llm.engine, prompt)[-1]
    p = logits[[i[0] for i in ids]].softmax(-1).tolist()
    grammar = GrammarSpec("choice", json.dumps(words))
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, seed=s, grammar=grammar) for s in range(600)
    ]
    texts = [r.outputs[0].text for r in llm.generate([prompt] * 600, params)]
    counts = [texts.count(w) for w in words]
    assert sum(counts) == 600
    chi2 = sum((c - 600 * q) ** 2 / (600 * q) for c, q in zip(counts, p))
    assert chi2 < 10.8, (counts, p)  # 1 dof, p = 0.001


def test_bad_grammars_are_param_errors(llm) -> None:
    for spec in [
        GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}'),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("grammar", "root ::= ("),
    ]:
        with pytest.raises(ParamError):
            llm.generate([PROMPTS[0]], SamplingParams(grammar=spec))
    assert not llm.engine.has_unfinished()


def test_grammar_end_stops_even_under_ignore_eos(llm) -> None:
    params = SamplingParams(
        max_tokens=50, ignore_eos=True, grammar=GrammarSpec("choice", '["yes", "no"]')
    )
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_strict_tools_under_auto_shape_only_the_calls(llm) -> None:
    """tool_choice auto with strict tools: free text stays free, and whatever follows a
    `<tool_call>` trigger must be a call to a listed tool with schema-valid arguments."""
    tool = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
    source = json.dumps({"format": "hermes", "mode": "free", "parallel": True, "tools": [tool]})
    spec = GrammarSpec("tool_calls", source)

    def accepts(text: str) -> bool:
        return llm.engine.structured.matcher(spec).accept_string(text)

    assert accepts("Let me check. ")
    assert accepts('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert not accepts('<tool_call>\n{"name": "get_time"')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": 5')


def test_a_vocabulary_that_cannot_spell_json_builds_and_refuses_only_json(
    llama_dir, tmp_path
) -> None:
    """The start-up warm-up compiles a JSON grammar; a word-level vocabulary (`t0`..`t511`, as
    the benches' tiny models have) cannot spell JSON. The engine still builds: its JSON requests
    are refused, while a grammar it can spell is served."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = tmp_path / "words"
    shutil.copytree(llama_dir, words)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(words / "tokenizer.json"))
    llm = LLM(str(words), num_kv_blocks=64, block_size=4)
    with pytest.raises(ParamError):
        llm.generate([PROMPTS[0]], SamplingParams(grammar=GrammarSpec("json_object", "")))
    choice = GrammarSpec("choice", json.dumps(["t7", "t9"]))
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, grammar=choice))
    assert out[0].outputs[0].token_ids[0] in (7, 9)  # the choice's token, then the end
