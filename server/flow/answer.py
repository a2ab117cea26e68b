"""One answer stream for every route: a choice's output text, read as it grows, becomes neutral
events (a thought's text, the answer's text, tool calls started, their arguments growing, ended,
and `Done` with how generation ended). Chat renders them as chunk deltas, the Messages API as
content blocks, the Responses API as output items: as they come when streaming, and folded
(`Answer.read`) for a whole body, so a whole answer is the stream's by construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.flow.reasoning import ReasoningPlan, ReasoningStream
from server.flow.tool_parsers import ToolCall, ToolParser, new_call_id, with_determined_name


@dataclass(frozen=True, slots=True)
class AnswerPlan:
    """How a choice's text is read: where its thought is (None: the model does not think), the
    parser that finds calls (None: calls are not parsed), the name a forced call must have
    (`ToolPlan.determined_name`) and how many calls are kept (None: as many as are made)."""

    reasoning: ReasoningPlan | None = None
    parser: ToolParser | None = None
    determined_name: str | None = None
    max_calls: int | None = None


@dataclass(frozen=True, slots=True)
class ThoughtDelta:
    text: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # the call's place among the output's calls
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgsDelta:
    index: int
    fragment: str  # of the arguments' JSON text: the fragments joined are the arguments


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int  # its arguments are complete, or the output ended inside them


@dataclass(frozen=True, slots=True)
class Done:
    """The output ended. `thought`: the model thought (an empty thought is still one: a whole
    body says so); `began_call`: call markup was begun, so the text around it is no answer's
    own, even when the cap cut the call off before its name."""

    finish_reason: str | None
    stop_reason: int | str | None
    thought: bool
    began_call: bool


AnswerEvent = ThoughtDelta | TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | Done


class AnswerStream:
    """The events of one choice's output, fed its text deltas in order. A possible tag or call
    marker at the end is held back until the next delta (or the end) decides it; at the end, an
    output in which no call was begun is released as written."""

    def __init__(self, plan: AnswerPlan) -> None:
        self.plan = plan
        self.thought = ReasoningStream(plan.reasoning) if plan.reasoning is not None else None
        self.text = ""  # the answer so far (after the thought), when calls are parsed
        self.text_sent = 0
        self.ids: list[str] = []  # per call begun with a name, in order
        self.args_sent: list[int] = []
        self.ended: set[int] = set()

    def feed(
        self,
        delta: str,
        finished: bool = False,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> list[AnswerEvent]:
        events: list[AnswerEvent] = []
        text = delta
        if self.thought is not None:
            thought, text = self.thought.feed(delta, finished)
            if thought:
                events.append(ThoughtDelta(thought))
        began_call = False
        if self.plan.parser is None:
            if text:
                events.append(TextDelta(text))
        else:
            began_call = self._calls(text, finished, events)
        if finished:
            reasoning = self.plan.reasoning
            thought = reasoning is not None and (reasoning.inside or self._opened())
            events.append(Done(finish_reason, stop_reason, thought, began_call))
        return events

    def _opened(self) -> bool:
        return self.thought is not None and self.thought.opened

    def _kept(self, index: int) -> bool:
        return self.plan.max_calls is None or index < self.plan.max_calls

    def _calls(self, delta: str, finished: bool, events: list[AnswerEvent]) -> bool:
        """The answer's text outside calls and each call's events; whether a call was begun."""
        assert self.plan.parser is not None
        self.text += delta
        parsed = self.plan.parser.parse(self.text)
        if finished:
            parsed = with_determined_name(parsed, self.plan.determined_name)
        # no call begun by the end: a held-back marker prefix was text after all
        content = self.text if finished and not parsed.calls else parsed.content
        if len(content) > self.text_sent:
            events.append(TextDelta(content[self.text_sent :]))
            self.text_sent = len(content)
        for i, call in enumerate(parsed.calls):
            if call.name is None:  # calls are told apart by name: none after a nameless one
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                if self._kept(i):
                    events.append(ToolCallStart(i, self.ids[i], call.name))
            fragment = call.arguments[self.args_sent[i] :]
            if fragment:
                self.args_sent[i] = len(call.arguments)
                if self._kept(i):
                    events.append(ToolCallArgsDelta(i, fragment))
            if (call.done or finished) and i not in self.ended:
                self.ended.add(i)
                if self._kept(i):
                    events.append(ToolCallEnd(i))
        return bool(parsed.calls)


@dataclass(slots=True)
class Answer:
    """A finished choice's events folded: the thought (None: the model did not think), the text
    outside calls (stripped around a begun call), the calls kept, and how it ended."""

    thought: str | None = None
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    began_call: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @classmethod
    def of(cls, events: list[AnswerEvent]) -> Answer:
        answer, thought, by_index = cls(), [], {}
        for e in events:
            if isinstance(e, ThoughtDelta):
                thought.append(e.text)
            elif isinstance(e, TextDelta):
                answer.text += e.text
            elif isinstance(e, ToolCallStart):
                by_index[e.index] = ToolCall(e.id, e.name, "")
                answer.calls.append(by_index[e.index])
            elif isinstance(e, ToolCallArgsDelta):
                by_index[e.index].arguments += e.fragment
            elif isinstance(e, Done):
                answer.thought = "".join(thought) if e.thought else None
                answer.began_call = e.began_call
                answer.finish_reason, answer.stop_reason = e.finish_reason, e.stop_reason
        if answer.began_call:
            answer.text = answer.text.strip()
        return answer

    @classmethod
    def read(
        cls,
        plan: AnswerPlan,
        text: str,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> Answer:
        """A whole output: its events in one feed, folded."""
        return cls.of(AnswerStream(plan).feed(text, True, finish_reason, stop_reason))
