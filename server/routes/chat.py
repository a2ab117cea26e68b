"""POST /v1/chat/completions, streaming or not, with tools and structured outputs."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine
from engine.core.outputs import RequestOutput
from server.flow.answer import (
    Answer,
    AnswerStream,
    TextDelta,
    ThoughtDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from server.flow.chat_plan import chat_plan
from server.flow.conversation_plan import ConversationPlan
from server.flow.generation import Choice, chat_logprobs, finish_reason
from server.flow.request_flow import ChoiceChunks, start
from server.protocol.openai import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from server.protocol.wire import parse_body, reply
from server.state import ServerState


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body = await parse_body(request, ChatCompletionRequest, state.config.server.max_body_bytes)
    state.check_model(body.model)
    engine = state.ready_engine()
    req_id = f"chatcmpl-{uuid.uuid4().hex}"
    plan = await chat_plan(state, engine, request, body, req_id)
    gen = await start(state, engine, request, plan.generation)
    with_logprobs = plan.generation.logprobs is not None
    legacy = body.functions is not None  # calls come back as `function_call`
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return gen.stream(ChatChunks(engine, with_logprobs, include_usage, plan, legacy))

    def message(ch: Choice) -> tuple[dict, str | None]:
        reason = finish_reason(ch.finish_reason)
        answer = Answer.read(plan.answer, ch.text)
        # an empty answer after a thought, or around a begun call, is no content
        empty = answer.began_call or answer.thought is not None
        msg: dict = {
            "role": "assistant",
            "content": answer.text or (None if empty else ""),
            "refusal": None,
        }
        if plan.answer.reasoning is not None:
            msg["reasoning_content"] = answer.thought
        calls = answer.calls
        if not calls:
            return msg, reason
        if legacy:
            msg["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            return msg, "function_call" if reason == "stop" else reason
        msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg, "tool_calls" if reason == "stop" else reason

    def respond(usage: dict) -> Response:
        out = []
        for ch in gen.choices:
            msg, reason = message(ch)
            lps = chat_logprobs(engine.tokenizer, ch.logprobs) if with_logprobs else None
            out.append(
                {"index": ch.index, "message": msg, "logprobs": lps, "finish_reason": reason}
            )
        return reply(
            ChatCompletionResponse,
            {**gen.head, "object": "chat.completion", "choices": out, "usage": usage},
        )

    return await gen.collect(request, respond)


class ChatChunks(ChoiceChunks):
    """Chat stream chunks: each choice's answer events as one delta per engine output (the
    thought as `reasoning_content`, calls as OpenAI's tool_calls deltas, or legacy
    function_call deltas)."""

    model = ChatCompletionChunk
    object = "chat.completion.chunk"

    def __init__(
        self,
        engine: AsyncEngine,
        logprobs: bool,
        include_usage: bool,
        plan: ConversationPlan,
        legacy: bool,
    ) -> None:
        super().__init__(include_usage)
        self.tokenizer = engine.tokenizer
        self.logprobs = logprobs
        self.answer, self.legacy = plan.answer, legacy
        self.streams: dict[int, AnswerStream] = {}
        self.called: set[int] = set()  # choices that made a call

    def opening(self, choice: Choice) -> dict:
        self.streams[choice.index] = AnswerStream(self.answer)
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta(self, choice: Choice, out: RequestOutput) -> dict | None:
        lp = chat_logprobs(self.tokenizer, out.logprobs) if self.logprobs else None
        events = self.streams[choice.index].feed(out.new_text, out.finished)
        thought = "".join(e.text for e in events if isinstance(e, ThoughtDelta))
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        calls = [call_delta(e) for e in events if isinstance(e, ToolCallStart | ToolCallArgsDelta)]
        if any(isinstance(e, ToolCallStart) for e in events):
            self.called.add(choice.index)
        if self.answer.parser is None:
            if not (text or thought or out.logprobs):
                return None
            delta: dict = {"content": text} if text or not thought else {}
        else:
            delta = {}
            if text:
                delta["content"] = text
            if calls and self.legacy:  # the first call only: its name, then arguments
                function: dict = {}
                for c in calls:
                    function.update(c["function"])
                delta["function_call"] = function
            elif calls:
                delta["tool_calls"] = calls
            if not delta and not thought and not out.logprobs:
                return None
        if thought:
            delta["reasoning_content"] = thought
        return {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": None}

    def closing(self, choice: Choice, out: RequestOutput) -> dict:
        reason = finish_reason(out.finish_reason)
        if choice.index in self.called and reason == "stop":
            reason = "function_call" if self.legacy else "tool_calls"
        return {"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": reason}


def call_delta(event: ToolCallStart | ToolCallArgsDelta) -> dict:
    """A call event as OpenAI's tool_calls delta: the header once, then arguments fragments."""
    if isinstance(event, ToolCallStart):
        function = {"name": event.name, "arguments": ""}
        return {"index": event.index, "id": event.id, "type": "function", "function": function}
    return {"index": event.index, "function": {"arguments": event.fragment}}
