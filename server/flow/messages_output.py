"""What an Anthropic Messages request gets back: the message (text and tool_use content blocks,
the stop reason, usage split the way Anthropic counts cache reads and writes) and its event
stream (message_start, ping, content blocks started, extended and stopped, message_delta,
message_stop; an `error` event when generation fails after the headers went out)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from engine.core.outputs import RequestOutput
from server.flow.answer import (
    Answer,
    AnswerPlan,
    AnswerStream,
    TextDelta,
    ThoughtDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from server.flow.generation import Choice
from server.flow.request_flow import Generation
from server.protocol.anthropic import AnthropicStreamEvent
from server.protocol.wire import dump

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(
    choice: Choice, made_calls: bool, stop_sequences: list[str]
) -> tuple[str, str | None]:
    """Anthropic's stop reason (and the stop sequence that ended the turn, if one did)."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(choice.stop_reason, str) and choice.stop_reason in stop_sequences:
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's input object; arguments cut off by max_tokens are not an object yet."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def signature(thinking: str) -> str:
    """A thinking block's signature: what the thought hashes to (a replayed thought is left
    out of the prompt either way; the field must be there for clients that check it)."""
    return "kvserve-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def content_blocks(answer: Answer, omit_thought: bool) -> list[dict[str, Any]]:
    """A finished choice's thought, text and calls as content blocks; `omit_thought`
    (`thinking.display: omitted`): the thinking block carries its signature, not its text."""
    blocks: list[dict[str, Any]] = []
    if answer.thought is not None:
        shown = "" if omit_thought else answer.thought
        blocks.append(
            {"type": "thinking", "thinking": shown, "signature": signature(answer.thought)}
        )
    if answer.text:
        blocks.append({"type": "text", "text": answer.text})
    for call in answer.calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": _tool_input(call.arguments),
            }
        )
    return blocks


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def messages_usage(
    usage: dict, block_size: int, prefix_caching: bool, cache_control: bool
) -> dict[str, int]:
    """Anthropic's split of the prompt: `cache_read_input_tokens` served from the prefix cache
    (any tier), `cache_creation_input_tokens` written to it in whole blocks when the request
    marks cache breakpoints, `input_tokens` the rest."""
    prompt = usage["prompt_tokens"]
    read = usage["prompt_tokens_details"]["cached_tokens"]
    written = 0
    if prefix_caching and cache_control:
        written = max(0, prompt // block_size * block_size - read)
    return {
        "input_tokens": prompt - read - written,
        "output_tokens": usage["completion_tokens"],
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
    }


def message_body(
    msg_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: tuple[str | None, str | None],
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


def event(kind: str, fields: dict[str, Any]) -> bytes:
    data = dump(AnthropicStreamEvent, {"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class MessagesEvents:
    """The Messages stream of one choice, from its answer events: a thought as thinking_delta
    events of a thinking block (signed when it closes), text as text_delta events of a text
    block, each call a tool_use block whose input arrives as input_json_delta fragments.
    `omit_thought`: a thinking block gets its signature and no thinking deltas."""

    def __init__(
        self,
        msg_id: str,
        answer: AnswerPlan,
        stop_sequences: list[str],
        usage_of: Callable[[dict], dict[str, int]],  # the request's usage -> Anthropic's
        omit_thought: bool = False,
    ) -> None:
        self.msg_id, self.stop_sequences = msg_id, stop_sequences
        self.omit_thought = omit_thought
        self.usage_of = usage_of
        self.answer = AnswerStream(answer)
        self.index = -1  # the content block now open (-1: none yet)
        self.open_kind: str | None = None
        self.call_blocks: dict[int, int] = {}  # call index -> content block index
        self.thought_text = ""
        self.model = ""

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open_kind = block["type"]
        return [*out, event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        out = []
        if self.open_kind == "thinking":  # a thought's signature closes it
            delta = {"type": "signature_delta", "signature": signature(self.thought_text)}
            out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        self.open_kind = None
        return [*out, event("content_block_stop", {"index": self.index})]

    def _thinking(self, text: str) -> list[bytes]:
        out = (
            []
            if self.open_kind == "thinking"
            else self._open({"type": "thinking", "thinking": "", "signature": ""})
        )
        self.thought_text += text
        if self.omit_thought:
            return out
        delta = {"type": "thinking_delta", "thinking": text}
        return [*out, event("content_block_delta", {"index": self.index, "delta": delta})]

    def _text(self, text: str) -> list[bytes]:
        out = [] if self.open_kind == "text" else self._open({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*out, event("content_block_delta", {"index": self.index, "delta": delta})]

    def _call(self, e: ToolCallStart) -> list[bytes]:
        block = {"type": "tool_use", "id": tool_use_id(e.id), "name": e.name, "input": {}}
        out = self._open(block)
        self.call_blocks[e.index] = self.index
        return out

    def _fragment(self, e: ToolCallArgsDelta) -> list[bytes]:
        delta = {"type": "input_json_delta", "partial_json": e.fragment}
        return [event("content_block_delta", {"index": self.call_blocks[e.index], "delta": delta})]

    def begin(self, gen: Generation) -> list[bytes]:
        self.model = gen.head["model"]
        prompt = len(gen.choices[0].prompt_ids)
        usage = {"input_tokens": prompt, "output_tokens": 0}
        start = message_body(self.msg_id, self.model, [], (None, None), usage)
        return [event("message_start", {"message": start}), event("ping", {})]

    def step(self, choice: Choice, out: RequestOutput) -> list[bytes]:
        events: list[bytes] = []
        for e in self.answer.feed(out.new_text, out.finished):
            if isinstance(e, ThoughtDelta):
                events += self._thinking(e.text)
            elif isinstance(e, TextDelta):
                events += self._text(e.text)
            elif isinstance(e, ToolCallStart):
                events += self._call(e)
            elif isinstance(e, ToolCallArgsDelta):
                events += self._fragment(e)
        return events

    def end(self, gen: Generation, usage: dict) -> list[bytes]:
        made_calls = bool(self.call_blocks)
        reason, sequence = stop_reason(gen.choices[0], made_calls, self.stop_sequences)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        final = {"delta": delta, "usage": self.usage_of(usage)}
        return [*self._close(), event("message_delta", final), event("message_stop", {})]

    def fail(self, gen: Generation, error: dict) -> list[bytes]:
        return [event("error", error_body(500, error["message"]))]
