"""Tool calls in model output, in the formats models are trained on (vLLM's parser names):

- `hermes` (Hermes, Qwen2/2.5/3, and our fallback for templates without tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, repeated for parallel calls;
- `llama3_json` (Llama 3.1+): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- `phi4_mini_json` (Phi-4-mini, whose template declares tools in `<|tool|>`):
  `functools[{"name": ..., "arguments": {...}}, ...]`;
- `gemma4` (Gemma 4, whose template spells calls `<|tool_call>`):
  `<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>` (server/flow/gemma4_calls.py).

Each parser reads a whole (or partial, while streaming) output and returns the content around the
calls and the calls found so far; the answer stream (server/flow/answer.py) turns successive
parses into call events, which each route renders in its own shape.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from server.flow.calls_common import Parsed, ParsedCall
from server.flow.calls_common import partial_prefix as _partial_prefix
from server.flow.gemma4_calls import Gemma4Parser

_DECODER = json.JSONDecoder()


def _value_after_key(obj_text: str, keys: tuple[str, ...]) -> tuple[str | None, bool, int]:
    """In a (possibly partial) JSON object, the raw text of the value of the first key in `keys`
    present: (text, complete, end offset)."""
    for key in keys:
        m = re.search('"' + re.escape(key) + r'"\s*:\s*', obj_text)
        if m is None:
            continue
        start = m.end()
        try:
            _, end = _DECODER.raw_decode(obj_text, start)
            return obj_text[start:end], True, end
        except json.JSONDecodeError:
            return _releasable(obj_text[start:]), False, len(obj_text)
    return None, False, 0


def _releasable(partial_value: str) -> str:
    """Of an incomplete JSON value, the part certain to belong to it: drop a trailing run of
    closing braces and whitespace (they may close the enclosing object instead)."""
    end = len(partial_value)
    while end and partial_value[end - 1] in "} \n\t\r":
        end -= 1
    return partial_value[:end]


def _name(obj_text: str) -> str | None:
    m = re.search(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', obj_text)
    return json.loads(f'"{m.group(1)}"') if m else None


def _call_from_object(obj_text: str, args_keys: tuple[str, ...]) -> ParsedCall:
    args, done, _ = _value_after_key(obj_text, args_keys)
    return ParsedCall(_name(obj_text), args or "", done)


class HermesParser:
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Parsed:
        out = Parsed("")
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                hold = _partial_prefix(tail, self.start)
                out.content += tail[: len(tail) - hold]
                out.in_call = hold > 0
                return out
            out.content += text[pos:i]
            body_start = i + len(self.start)
            j = text.find(self.end, body_start)
            body = text[body_start : j if j >= 0 else len(text)]
            call = _call_from_object(body, ("arguments", "parameters"))
            if j < 0:
                out.calls.append(call)
                out.in_call = True
                return out
            out.calls.append(call if call.done else ParsedCall(call.name, call.arguments, False))
            pos = j + len(self.end)


class Llama3JsonParser:
    """Llama 3.1's JSON calls: the whole output is the call(s) when it starts with `{` (or the
    python tag); otherwise it is content."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        stripped = text.lstrip()
        if stripped.startswith(self.tag):
            stripped = stripped[len(self.tag) :].lstrip()
        if not stripped:
            return Parsed("", in_call=_partial_prefix(text.lstrip(), self.tag) > 0 or not text)
        if not stripped.startswith("{"):
            return Parsed(text)
        out = Parsed("", in_call=True)
        pos = 0
        while pos < len(stripped):
            try:
                obj, end = _DECODER.raw_decode(stripped, pos)
            except json.JSONDecodeError:
                out.calls.append(_call_from_object(stripped[pos:], ("parameters", "arguments")))
                return out
            if not isinstance(obj, dict):
                return Parsed(text)
            call = _call_from_object(stripped[pos:end], ("parameters", "arguments"))
            out.calls.append(call)
            rest = stripped[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            pos = len(stripped) - len(rest)
        out.in_call = False
        return out


class MarkedListParser:
    """A marker, then a JSON list of {"name", "arguments"} objects (Mistral's, Phi-4-mini's)."""

    def __init__(self, name: str, marker: str) -> None:
        self.name, self.marker = name, marker

    def parse(self, text: str) -> Parsed:
        i = text.find(self.marker)
        if i < 0:
            hold = _partial_prefix(text, self.marker)
            return Parsed(text[: len(text) - hold], in_call=hold > 0)
        out = Parsed(text[:i], in_call=True)
        body = text[i + len(self.marker) :].lstrip()
        if body.startswith("["):
            body = body[1:]
        pos = 0
        while True:
            rest = body[pos:].lstrip().lstrip(",").lstrip()
            pos = len(body) - len(rest)
            if not rest or rest.startswith("]"):
                out.in_call = not rest
                return out
            try:
                _, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                out.calls.append(_call_from_object(rest, ("arguments",)))
                return out
            out.calls.append(_call_from_object(body[pos:end], ("arguments",)))
            pos = end


PARSERS = {
    p.name: p
    for p in (
        HermesParser(),
        Llama3JsonParser(),
        MarkedListParser("mistral", "[TOOL_CALLS]"),
        MarkedListParser("phi4_mini_json", "functools["),
        Gemma4Parser(),
    )
}
ToolParser = HermesParser | Llama3JsonParser | MarkedListParser | Gemma4Parser


def parser_for_template(template: str | None) -> ToolParser:
    """The format a chat template teaches; hermes for templates that know no tools (our
    fallback prompt teaches that one)."""
    source = template or ""
    if "<|tool_call>" in source:
        return PARSERS["gemma4"]
    if "[TOOL_CALLS]" in source:
        return PARSERS["mistral"]
    if "<|tool|>" in source:
        return PARSERS["phi4_mini_json"]
    if "<|python_tag|>" in source or "ipython" in source:
        return PARSERS["llama3_json"]
    return PARSERS["hermes"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def with_determined_name(parsed: Parsed, name: str | None) -> Parsed:
    """A finished output as the calls it holds, where the grammar determined the first call's
    name (`ToolPlan.determined_name`): cut off inside its opening or its name, it is still that
    call, with the arguments generated so far (none)."""
    if name is None or any(c.name for c in parsed.calls):
        return parsed
    if parsed.calls:
        first = parsed.calls[0]
        return Parsed(parsed.content, [ParsedCall(name, first.arguments, False)], True)
    if parsed.in_call:  # the text ends inside the call's opening marker
        return Parsed(parsed.content, [ParsedCall(name, "", False)], True)
    return parsed
