"""The one answer stream (server/flow/answer.py) every route renders: a thought, text and calls
read the same whether the output arrives whole or in pieces, so a whole body (the events folded)
and a stream of the same output agree on every route. No model: text in, events out."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server.flow.answer import (
    Answer,
    AnswerPlan,
    AnswerStream,
    Done,
    TextDelta,
    ThoughtDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from server.flow.reasoning import ReasoningPlan
from server.flow.tool_parsers import PARSERS

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>'
PIECES = [
    "<think>",
    "</think>",
    "plan ",
    " ",
    "\n",
    CALL,
    "<tool_c",
    "[TOOL_CALLS]",
    '[{"name": "g", "arguments": {}}]',
    "Paris.",
]
PLANS = [
    AnswerPlan(),
    AnswerPlan(ReasoningPlan(inside=True)),
    AnswerPlan(ReasoningPlan(inside=False), PARSERS["hermes"]),
    AnswerPlan(None, PARSERS["hermes"], "f", 1),
    AnswerPlan(ReasoningPlan(inside=True), PARSERS["mistral"]),
]


def folded(answer: Answer) -> tuple:
    """An answer without its call ids (new for every read)."""
    calls = [(c.name, c.arguments) for c in answer.calls]
    return answer.thought, answer.text, calls, answer.began_call


@given(pieces=st.lists(st.sampled_from(PIECES), max_size=8), cuts=st.lists(st.integers(0, 200)))
def test_an_answer_reads_the_same_however_its_text_arrives(pieces, cuts) -> None:
    text = "".join(pieces)
    for plan in PLANS:
        whole = Answer.read(plan, text, "stop")
        stream, events, last = AnswerStream(plan), [], 0
        for cut in sorted({c for c in cuts if c < len(text)}) + [len(text)]:
            events += stream.feed(text[last:cut], cut == len(text), "stop")
            last = cut
        assert folded(Answer.of(events)) == folded(whole), (plan, text)
        assert isinstance(events[-1], Done) and sum(isinstance(e, Done) for e in events) == 1


def test_a_thought_then_a_call_then_text() -> None:
    plan = AnswerPlan(ReasoningPlan(inside=False), PARSERS["hermes"])
    events = AnswerStream(plan).feed("<think>hm</think>" + CALL + "\nok", True, "stop")
    kinds = [type(e) for e in events]
    assert kinds == [ThoughtDelta, TextDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd, Done]
    answer = Answer.of(events)
    assert answer.thought == "hm" and answer.text == "ok" and answer.began_call
    assert [(c.name, c.arguments) for c in answer.calls] == [("f", '{"a": [1, "}"]}')]


def test_calls_past_the_limit_are_read_but_not_told() -> None:
    plan = AnswerPlan(None, PARSERS["hermes"], None, 1)
    answer = Answer.read(plan, CALL + CALL.replace('"f"', '"g"'), "stop")
    assert [c.name for c in answer.calls] == ["f"]


def test_a_forced_call_cut_before_its_name_is_still_that_call() -> None:
    plan = AnswerPlan(None, PARSERS["hermes"], "f", None)
    answer = Answer.read(plan, "<tool_call>\n{", "length")
    assert [(c.name, c.arguments) for c in answer.calls] == [("f", "")]
    assert answer.text == "" and answer.finish_reason == "length"


def test_no_call_begun_is_the_text_as_written() -> None:
    plan = AnswerPlan(None, PARSERS["hermes"])
    answer = Answer.read(plan, " almost <tool_c", "length")
    assert answer.text == " almost <tool_c" and not answer.began_call and not answer.calls
    assert Answer.read(AnswerPlan(ReasoningPlan(inside=False)), "<think></think>x").thought == ""
    assert Answer.read(AnswerPlan(ReasoningPlan(inside=False)), "x").thought is None
