"""What every tool-call parser (server/flow/tool_parsers.py, server/flow/gemma4_calls.py)
returns: the content around the calls and the calls found so far, whole or partial."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ParsedCall:
    name: str | None  # None until the name is complete
    arguments: str  # raw JSON text of the arguments seen so far
    done: bool  # the arguments are a complete JSON value


@dataclass(slots=True)
class Parsed:
    content: str  # text outside the calls (so far)
    calls: list[ParsedCall] = field(default_factory=list)
    in_call: bool = False  # the text ends inside a call (or a marker that may start one)


def partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
