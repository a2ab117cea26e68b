"""A model's thought apart from its answer: templates that think (Qwen3, DeepSeek-R1 and their
kin) wrap it in `<think>` ... `</think>`, opened by the model itself or already by the
generation prompt. The text up to the close is reasoning (chat's `reasoning_content`, a
Responses reasoning item, an Anthropic thinking block); what follows is the answer, where tool
calls are then looked for. A thought never closed (cut by the token cap) is all reasoning."""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template spells thoughts the way this module reads them (it opens one in
    the generation prompt, renders past ones, or strips them from history)."""
    return template is not None and OPEN in template


def opened_by_prompt(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open thought (DeepSeek-R1's generation
    prompt opens it; Qwen3's with thinking off writes an empty, closed one)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


@dataclass(frozen=True)
class ReasoningPlan:
    """How a request's output is split: `inside` when generation starts inside the thought."""

    inside: bool


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Successive deltas of a growing output, as (reasoning, answer) deltas; a possible tag
    prefix at the end is held back until the next delta (or the end) decides it."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.state = "inside" if plan.inside else "start"
        self.pending = ""
        self.opened = False  # the model opened a thought itself (an empty one counts)

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.pending += delta
        reasoning, answer = "", ""
        while True:
            if self.state == "start":  # outside, before any answer: a thought may open
                stripped = self.pending.lstrip()
                if stripped.startswith(OPEN):
                    self.pending = stripped[len(OPEN) :]
                    self.state, self.opened = "inside", True
                    continue
                if OPEN.startswith(stripped) and not finished:
                    break  # whitespace or a prefix of the tag so far: wait
                self.state = "answer"
                continue
            if self.state == "inside":
                end = self.pending.find(CLOSE)
                if end >= 0:
                    reasoning += self.pending[:end]
                    self.pending = self.pending[end + len(CLOSE) :]
                    self.state = "closed"
                    continue
                keep = 0 if finished else _held(self.pending, CLOSE)
                reasoning += self.pending[: len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep :]
                break
            if self.state == "closed":  # the newlines after the close separate, in any delta
                self.pending = self.pending.lstrip("\n")
                if not self.pending and not finished:
                    break
                self.state = "answer"
                continue
            answer += self.pending
            self.pending = ""
            break
        return reasoning, answer
