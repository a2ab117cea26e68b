"""Gemma 4's tool calls (transformers' `gemma4` response format):
`<|tool_call>call:NAME{ARGS}<tool_call|>`, repeated for parallel calls, where ARGS is a JSON-like
object with unquoted keys and strings between `<|"|>` marks instead of quotes (their text is
literal: no escapes). `to_json` turns such an object, whole or cut off, into the JSON text of
the same value; a cut-off object's text is a prefix of the whole one's, so arguments stream."""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.flow.calls_common import Parsed, ParsedCall, partial_prefix

START, END, CALL = "<|tool_call>", "<tool_call|>", "call:"
QUOTE = '<|"|>'
_BARE_END = ",:}] \n\t\r"


@dataclass(slots=True)
class Converted:
    json: str  # JSON text so far
    end: int  # offset just past the object's closing brace (or len(text) if not closed)
    done: bool  # the object was closed


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def to_json(text: str, start: int = 0) -> Converted:
    """The object (or array) opening at `text[start]` as JSON: keys quoted, `<|"|>` strings
    as JSON strings, bare values (numbers, true, false, null) as written, whitespace outside
    strings dropped. A possible `<|"|>` prefix at the end is held back."""
    out: list[str] = []
    stack: list[str] = []  # open brackets
    expect_key = False  # inside an object, at a key's place
    i, n = start, len(text)
    while i < n:
        ch = text[i]
        if text.startswith(QUOTE, i):  # a <|"|> string
            j = text.find(QUOTE, i + len(QUOTE))
            body_end = j if j >= 0 else n
            body = text[i + len(QUOTE) : body_end]
            if j < 0:
                body = body[: len(body) - partial_prefix(body, QUOTE)]
            out.append('"' + _escaped(body) + ('"' if j >= 0 else ""))
            if j < 0:
                return Converted("".join(out), n, False)
            i, expect_key = j + len(QUOTE), False
            continue
        if QUOTE.startswith(text[i:]) and ch == "<":  # a cut-off <|"|>
            return Converted("".join(out), n, False)
        if ch == '"':  # a JSON string, copied (a model may write one)
            j, esc = i + 1, False
            while j < n and (esc or text[j] != '"'):
                esc = not esc and text[j] == "\\"
                j += 1
            out.append(text[i : min(j + 1, n)])
            if j >= n:
                return Converted("".join(out), n, False)
            i, expect_key = j + 1, False
            continue
        if ch in " \n\t\r":
            i += 1
            continue
        if ch in "{[":
            stack.append(ch)
            out.append(ch)
            expect_key = ch == "{"
        elif ch in "}]":
            if stack:
                stack.pop()
            out.append(ch)
            expect_key = False
            if not stack:
                return Converted("".join(out), i + 1, True)
        elif ch == ",":
            out.append(ch)
            expect_key = bool(stack) and stack[-1] == "{"
        elif ch == ":":
            out.append(ch)
            expect_key = False
        elif expect_key:  # an unquoted key, up to its colon
            j = text.find(":", i)
            key = text[i : j if j >= 0 else n].rstrip()
            out.append('"' + _escaped(key) + ('":' if j >= 0 else ""))
            if j < 0:
                return Converted("".join(out), n, False)
            i, expect_key = j + 1, False
            continue
        else:  # a bare value: number, true, false, null
            j = i
            while j < n and text[j] not in _BARE_END and not text.startswith(QUOTE, j):
                j += 1
            out.append(text[i:j])
            i = j
            continue
        i += 1
    return Converted("".join(out), n, False)


class Gemma4Parser:
    name = "gemma4"
    start, end = START, END

    def parse(self, text: str) -> Parsed:
        out = Parsed("")
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                tail = text[pos:]
                hold = partial_prefix(tail, START)
                out.content += tail[: len(tail) - hold]
                out.in_call = hold > 0
                return out
            out.content += text[pos:i]
            out.in_call = True
            body = i + len(START)
            brace = text.find("{", body)
            if brace < 0:  # the name is not complete yet
                out.calls.append(ParsedCall(None, "", False))
                return out
            name = text[body:brace].strip()
            name = name[len(CALL) :] if name.startswith(CALL) else name
            conv = to_json(text, brace)
            close = text.find(END, conv.end) if conv.done else text.find(END, brace)
            if close >= 0 and not conv.done:  # arguments malformed: closed all the same
                conv = to_json(text[:close], brace)
            out.calls.append(ParsedCall(name, conv.json, conv.done))
            if close < 0:
                return out
            pos = close + len(END)
            out.in_call = False
