"""Responses API items: the request's `input` as stored item resources (each with an id), what a
replayed reasoning item carries, and `OutputItems`, which renders a choice's answer events as
output items (reasoning, a message, function calls) and the stream events that build them. The
same machine serves streamed and whole responses, so both end with the same items."""

from __future__ import annotations

import base64
import uuid
from typing import Any

from engine.core.sampled import TokenLogprobs
from models.tokenizer import Tokenizer
from server.errors import APIError
from server.flow.answer import (
    AnswerEvent,
    AnswerPlan,
    Done,
    TextDelta,
    ThoughtDelta,
    ToolCallArgsDelta,
    ToolCallStart,
)
from server.flow.generation import chat_logprobs
from server.protocol.responses import InputItem, InputPart


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def model_function_name(namespace: str | None, name: str) -> str:
    """What the model sees and calls for a function: a namespace's functions are flattened into
    one list as `namespace.name` (function names may hold dots; a namespace never does)."""
    return f"{namespace}.{name}" if namespace else name


def call_name(name: str, namespaces: frozenset[str]) -> dict[str, str]:
    """A model call's `name` (and `namespace`) fields as the client named the function."""
    namespace, dot, rest = name.partition(".")
    if dot and namespace in namespaces:
        return {"namespace": namespace, "name": rest}
    return {"name": name}


def message_item(
    item_id: str, status: str, role: str, content: list[dict[str, Any]]
) -> dict[str, Any]:
    """A message item resource (the client's, stored, or the model's answer)."""
    return {"type": "message", "id": item_id, "status": status, "role": role, "content": content}


def call_item(
    item_id: str, call_id: str | None, name: dict[str, str], arguments: str | None, status: str
) -> dict[str, Any]:
    """A function_call item resource; `name`: its `name` field, and `namespace` where it has one
    (`call_name`)."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        **name,
        "arguments": arguments,
        "status": status,
    }


def _part_text(parts: str | list[InputPart], where: str) -> str:
    return "".join(p["text"] for p in _parts(parts, where, images=False))


def _parts(parts: str | list[InputPart], where: str, images: bool = True) -> list[dict[str, Any]]:
    """Text parts (and, where a message may hold them, input_image parts) as stored: the text
    of consecutive text parts joined into one."""
    if isinstance(parts, str):
        return [{"type": "input_text", "text": parts}]
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        at = f"{where}.{j}"
        if part.type in ("input_text", "output_text", "text") and part.text is not None:
            if out and out[-1]["type"] == "input_text":
                out[-1]["text"] += part.text
            else:
                out.append({"type": "input_text", "text": part.text})
        elif images and part.type == "input_image" and part.image_url is not None:
            out.append(
                {
                    "type": "input_image",
                    "image_url": part.image_url,
                    "detail": part.detail or "auto",
                }
            )
        else:
            why = f"a {part.type!r} part cannot be read (send input_text or input_image parts)"
            if part.type == "input_image":
                why = "an input_image part needs image_url (a data: URL or http(s) URL)"
            raise APIError(400, f"{at}: {why}", param=at, code="unsupported_content")
    return out or [{"type": "input_text", "text": ""}]


def seal(thought: str) -> str:
    """A thought as `encrypted_content`: opaque to the client, restored exactly on replay (not
    secret: the client may read its own model's thought anyway)."""
    return base64.b64encode(thought.encode()).decode()


def unseal(content: str) -> str | None:
    try:
        return base64.b64decode(content, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None  # another server's sealed thought: nothing to restore


def _reasoning_item(item: InputItem) -> dict[str, Any]:
    parts = item.content if isinstance(item.content, list) else []
    return {
        "type": "reasoning",
        "id": item.id or new_id("rs"),
        "summary": [{"type": "summary_text", "text": p.text or ""} for p in item.summary or []],
        "content": [{"type": "reasoning_text", "text": p.text or ""} for p in parts] or None,
        "encrypted_content": item.encrypted_content,
    }


def thought_of(item: dict[str, Any]) -> str | None:
    """The thought a replayed reasoning item carries: sealed, else its text, else its summary."""
    if item.get("encrypted_content"):
        sealed = unseal(item["encrypted_content"])
        if sealed is not None:
            return sealed
    for key in ("content", "summary"):
        if item.get(key):
            return "".join(p["text"] for p in item[key])
    return None


def input_items(value: str | list[InputItem]) -> list[dict[str, Any]]:
    """`input` as item resources: a string is one user message; ids are kept or assigned."""
    if isinstance(value, str):
        value = [InputItem(type="message", role="user", content=value)]
    items: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        if item.type == "message":
            assert item.role is not None and item.content is not None
            assistant = item.role == "assistant"
            content = _parts(item.content, f"{where}.content", images=not assistant)
            if assistant:
                text = "".join(p["text"] for p in content)
                content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            items.append(message_item(item.id or new_id("msg"), "completed", item.role, content))
        elif item.type == "function_call":
            assert item.name is not None
            name = {"namespace": item.namespace} if item.namespace else {}
            name["name"] = item.name
            item_id = item.id or new_id("fc")
            items.append(call_item(item_id, item.call_id, name, item.arguments, "completed"))
        elif item.type == "function_call_output":
            assert item.output is not None
            items.append(
                {
                    "type": "function_call_output",
                    "id": item.id or new_id("fco"),
                    "call_id": item.call_id,
                    "output": _part_text(item.output, f"{where}.output"),
                    "status": "completed",
                }
            )
        elif item.type == "reasoning":
            items.append(_reasoning_item(item))
        else:
            raise APIError(
                400,
                f"{where}.type: {item.type!r} items are not supported here (messages, "
                "function_call, function_call_output and reasoning are)",
                param=f"{where}.type",
                code="unsupported_item",
            )
    return items


def status_of(finish_reason: str | None) -> str:
    """A response's (and its last item's) status from how generation ended."""
    return "incomplete" if finish_reason == "length" else "completed"


class OutputItems:
    """A choice's answer events (server/flow/answer.py) rendered as output items (a reasoning
    item, a message, function calls), with the stream events that build them. `render` returns
    events as (type, fields) pairs, sequence numbers left to the caller."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        answer: AnswerPlan,
        with_logprobs: bool,
        namespaces: frozenset[str] = frozenset(),
        summary: bool = False,  # the thought as the reasoning item's summary too
        sealed: bool = False,  # and as its encrypted_content
    ) -> None:
        self.tokenizer = tokenizer
        self.plan = answer  # whether thoughts and calls are read at all
        self.summary, self.sealed = summary, sealed
        self.namespaces = namespaces  # calls named `namespace.name` are mapped back
        self.with_logprobs = with_logprobs
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item still being written
        self.call_items: dict[int, dict[str, Any]] = {}  # call index -> item
        self.held = ""  # whitespace not yet known to belong to a message
        self.status = "in_progress"  # the response's, once the answer is done

    def render(
        self, answer: list[AnswerEvent], logprobs: list[TokenLogprobs]
    ) -> list[tuple[str, dict[str, Any]]]:
        """The events of one engine output's answer events (and its tokens' logprobs)."""
        events: list[tuple[str, dict[str, Any]]] = []
        lps = self._logprobs(logprobs)
        thought = "".join(e.text for e in answer if isinstance(e, ThoughtDelta))
        content = "".join(e.text for e in answer if isinstance(e, TextDelta))
        done = next((e for e in answer if isinstance(e, Done)), None)
        if thought:
            events += self._reasoning(thought)
        calls = [e for e in answer if isinstance(e, ToolCallStart | ToolCallArgsDelta)]
        parsed = self.plan.parser is not None
        thinking = not self.items or self.items[-1]["type"] == "reasoning"
        if self.plan.reasoning is not None and thinking and not (content or calls or done):
            return events  # still thinking: the answer's logprobs wait with its text
        if parsed and not content.strip():
            # whitespace around calls (the newlines between <tool_call> blocks) is no message
            self.held += content
        elif content or (lps and not parsed):
            events += self._text(self.held + content, lps)
            self.held = ""
        for e in calls:
            events += self._call(e)
        if done is not None:
            if not self.items:
                events += self._text("", [])
            self.status = status_of(done.finish_reason)
            events += self._close(self.status)
        return events

    def _logprobs(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        if not self.with_logprobs or not entries or self.tokenizer is None:
            return []
        return chat_logprobs(self.tokenizer, entries)["content"]

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        """Where an item's events point: its place in the output and its id."""
        return {"output_index": self.items.index(item), "item_id": item["id"]}

    def _open(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Close the open item, start `item`, and announce it."""
        events = self._close("completed")
        self.open = item
        self.items.append(item)
        added = {"output_index": len(self.items) - 1, "item": _copy(item)}
        return [*events, ("response.output_item.added", added)]

    def _text(self, delta: str, lps: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            message = message_item(new_id("msg"), "in_progress", "assistant", [])
            events += self._open(message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            message["content"].append(part)
            at = {**self._at(message), "content_index": 0}
            events.append(("response.content_part.added", {**at, "part": dict(part)}))
        assert self.open is not None
        part = self.open["content"][0]
        part["text"] += delta
        part["logprobs"] += lps
        if delta or lps:
            at = {**self._at(self.open), "content_index": 0}
            events.append(("response.output_text.delta", {**at, "delta": delta, "logprobs": lps}))
        return events

    def _reasoning(self, delta: str) -> list[tuple[str, dict[str, Any]]]:
        if not delta:
            return []
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            text = {"type": "reasoning_text", "text": ""}
            item = {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [text],
                "status": "in_progress",
            }
            events += self._open(item)
        assert self.open is not None
        self.open["content"][0]["text"] += delta
        at = {**self._at(self.open), "content_index": 0}
        return [*events, ("response.reasoning_text.delta", {**at, "delta": delta})]

    def _close_reasoning(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        where = self._at(item)
        thought = item["content"][0]["text"]
        events = [("response.reasoning_text.done", {**where, "content_index": 0, "text": thought})]
        if self.summary:
            part = {"type": "summary_text", "text": thought}
            item["summary"].append(part)
            at = {**where, "summary_index": 0}
            events += [
                ("response.reasoning_summary_part.added", {**at, "part": {**part, "text": ""}}),
                ("response.reasoning_summary_text.delta", {**at, "delta": thought}),
                ("response.reasoning_summary_text.done", {**at, "text": thought}),
                ("response.reasoning_summary_part.done", {**at, "part": dict(part)}),
            ]
        if self.sealed:
            item["encrypted_content"] = seal(thought)
        return events

    def _call(self, e: ToolCallStart | ToolCallArgsDelta) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(e, ToolCallStart):  # a new call: its header
            name = call_name(e.name, self.namespaces)
            call = call_item(new_id("fc"), e.id, name, "", "in_progress")
            self.call_items[e.index] = call
            return self._open(call)
        item = self.call_items[e.index]
        item["arguments"] += e.fragment
        at = self._at(item)
        return [("response.function_call_arguments.delta", {**at, "delta": e.fragment})]

    def _close(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._at(item)
        events: list[tuple[str, dict[str, Any]]] = []
        if item["type"] == "reasoning":
            events += self._close_reasoning(item)
        elif item["type"] == "message":
            part = item["content"][0]
            at = {**where, "content_index": 0}
            events.append(
                ("response.output_text.done", {**at, "text": part["text"], "logprobs": []})
            )
            events.append(("response.content_part.done", {**at, "part": dict(part)}))
        else:
            events.append(
                (
                    "response.function_call_arguments.done",
                    {**where, "name": item["name"], "arguments": item["arguments"]},
                )
            )
        item["status"] = status
        events.append(
            (
                "response.output_item.done",
                {"output_index": where["output_index"], "item": _copy(item)},
            )
        )
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    for key in ("content", "summary"):
        if out.get(key) is not None:
            out[key] = [dict(p) for p in out[key]]
    return out
