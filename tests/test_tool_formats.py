"""Forced tool calls in every tool-call format the server parses (hermes, llama3_json, mistral,
phi4_mini_json, gemma4):
`required`, a named function and strict tools are enforced by the grammar in the format the
model's template teaches, and come back as OpenAI tool calls, whole and streamed."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from engine.grammar.structured_output import CALL_FORMATS
from tests.conftest import build_model
from tests.server_utils import InProcessServer
from tests.tool_schemas import ASK, TIME, WEATHER, ask_for_a_tool

pytestmark = pytest.mark.slow  # in-process servers


@pytest.fixture(scope="module")
def trigger_model(tmp_path_factory) -> Path:
    """The tests' tiny Llama, its tokenizer spelling each format's call trigger as one token,
    as tool-calling models' do (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`)."""
    out = build_model("llama", tmp_path_factory.mktemp("triggers") / "llama")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    triggers = [f.trigger for f in CALL_FORMATS.values()]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in triggers])
    tok.save(str(out / "tokenizer.json"))
    return out


FORMATS = ["hermes", "llama3_json", "mistral", "phi4_mini_json", "gemma4"]


@pytest.fixture(scope="module", params=FORMATS)
def served(request, trigger_model):
    server = InProcessServer(trigger_model, max_model_len=2048, tool_call_parser=request.param)
    yield server, request.param
    server.stop()


@pytest.fixture
def client(served):
    server, _ = served
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


def test_every_parser_is_a_setting_and_a_grammar() -> None:
    from server.config import PARSER_NAMES
    from server.flow.tool_parsers import PARSERS, parser_for_template

    assert set(PARSER_NAMES) == set(PARSERS) == set(CALL_FORMATS)
    phi4 = "{% if tools %}<|tool|>{{ tools }}<|/tool|>{% endif %}"  # Phi-4-mini's declaration
    assert parser_for_template(phi4).name == "phi4_mini_json"
    got = PARSERS["phi4_mini_json"].parse('ok functools[{"name": "f", "arguments": {"a": 1}}]')
    assert got.content == "ok "
    assert [(c.name, c.arguments) for c in got.calls] == [("f", '{"a": 1}')]


# a Gemma-4-like template: how it declares tools, thoughts and calls (the marks are Gemma 4's)
GEMMA4 = (
    "{% for m in messages %}<|turn>{{ m.role }}\n"
    "{% if m.reasoning_content %}<|channel>thought\n{{ m.reasoning_content }}<channel|>{% endif %}"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}"
    "{{ c.function.arguments }}<tool_call|>{% endfor %}{{ m.content }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
GEMMA4_OUT = (
    "<|channel>thought\nThe user wants {weather}.<channel|>Let me check. "
    '<|tool_call>call:get_weather{city:<|"|>Paris, "FR" {x}: 1<|"|>,days:-1.5e2,ok:true,'
    'none:null,nest:{a:[1,<|"|>b,]<|"|>,{c:false}],d:{}},e:[]}<tool_call|>'
    '<|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|>'
)
GEMMA4_ARGS = {
    "city": 'Paris, "FR" {x}: 1',
    "days": -150.0,
    "ok": True,
    "none": None,
    "nest": {"a": [1, "b,]", {"c": False}], "d": {}},
    "e": [],
}


def test_gemma4_is_declared_and_read_whole_and_streamed() -> None:
    from server.flow.answer import Answer, AnswerPlan, AnswerStream
    from server.flow.reasoning import ReasoningPlan, thought_tags
    from server.flow.tool_parsers import PARSERS, parser_for_template

    assert parser_for_template(GEMMA4).name == "gemma4"
    tags = thought_tags(GEMMA4)
    assert tags == ("<|channel>thought\n", "<channel|>")
    plan = AnswerPlan(ReasoningPlan(False, *tags), PARSERS["gemma4"])
    whole = Answer.read(plan, GEMMA4_OUT, "tool_calls")
    assert whole.thought == "The user wants {weather}."
    assert whole.text == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", GEMMA4_ARGS),
        ("get_time", {"zone": "UTC"}),
    ]
    for step in (1, 2, 5):  # streamed in pieces, cut anywhere (inside marks and strings too)
        stream, events = AnswerStream(plan), []
        for i in range(0, len(GEMMA4_OUT), step):
            events += stream.feed(GEMMA4_OUT[i : i + step])
        events += stream.feed("", True, "tool_calls")
        streamed = Answer.of(events)
        assert (streamed.thought, streamed.text) == (whole.thought, whole.text)
        assert [(c.name, c.arguments) for c in streamed.calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
    plain = Answer.read(plan, "No call: a <|tool and {a:1}", "stop")
    assert (plain.thought, plain.text, plain.calls) == (None, "No call: a <|tool and {a:1}", [])


def test_gemma4_grammar_spells_calls_as_the_parser_reads_them() -> None:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from engine.core.sampling_params import GrammarSpec
    from engine.grammar.structured_output import grammar_source
    from server.flow.tool_parsers import PARSERS

    tools = [WEATHER["function"], TIME["function"]]
    spec = {"format": "gemma4", "tools": tools, "parallel": True, "mode": "forced"}
    grammar = xgr.Grammar.from_ebnf(grammar_source(GrammarSpec("tool_calls", json.dumps(spec))))
    call = '<|tool_call>call:get_time{zone:<|"|>Europe/Paris<|"|>}<tool_call|>'
    assert accepts(grammar, call) and accepts(grammar, call + call)
    assert not accepts(grammar, '<|tool_call>call:get_time{"zone":"UTC"}<tool_call|>')
    assert not accepts(grammar, "plain text")
    (got,) = PARSERS["gemma4"].parse(call).calls
    assert (got.name, json.loads(got.arguments)) == ("get_time", {"zone": "Europe/Paris"})


def check(call, name: str | None = None) -> None:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "get_time" and set(args) == {"zone"}
    assert name is None or call.function.name == name


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_in_the_format(client, choice) -> None:
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    kw = dict(
        model="",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    r = client.chat.completions.create(**kw)
    choice_out = r.choices[0]
    assert choice_out.finish_reason == "tool_calls", choice_out
    assert choice_out.message.content is None
    (call,) = choice_out.message.tool_calls
    check(call, None if choice == "required" else "get_time")
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, {"name": None, "arguments": ""})
            entry["name"] = entry["name"] or (tc.function.name if tc.function else None)
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (call.function.name, call.function.arguments)
    ]


def test_strict_tools_shape_the_calls_the_model_chooses(served, client) -> None:
    """Under `auto` the model chooses whether to call; a random model would not, so the
    format's trigger (one token) is favoured by logit_bias: once the model writes it, the strict
    schema alone decides what follows (the bias cannot push a token the grammar masks)."""
    server, parser = served
    trigger = CALL_FORMATS[parser].trigger
    body = {"prompt": trigger, "add_special_tokens": False}
    ids = httpx.post(server.base + "/tokenize", json=body).json()["tokens"]
    assert len(ids) == 1, ids
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    r = ask_for_a_tool(
        client,
        model="",
        tools=[strict],
        tool_choice="auto",
        max_tokens=120,
        parallel_tool_calls=False,
        logit_bias={str(i): 100 for i in ids},
    )
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0]
    assert r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        check(call, "get_weather")
