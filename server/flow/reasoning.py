"""A model's thought apart from its answer: templates that think (Qwen3, DeepSeek-R1 and their
kin) wrap it in `<think>` ... `</think>` (Gemma 4's in `<|channel>thought\n` ... `<channel|>`),
opened by the model itself or already by the generation prompt. The text up to the close is
reasoning (chat's `reasoning_content`, a Responses reasoning item, an Anthropic thinking
block); what follows is the answer, where tool calls are then looked for. A thought never
closed (cut by the token cap) is all reasoning."""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
GEMMA4_OPEN, GEMMA4_CLOSE = "<|channel>thought\n", "<channel|>"


def thought_tags(template: str | None) -> tuple[str, str] | None:
    """The marks a chat template spells thoughts with, when it uses ones this module reads
    (it opens one in the generation prompt, renders past ones, or strips them from history)."""
    if template is None:
        return None
    if OPEN in template:
        return OPEN, CLOSE
    if "<|channel>" in template and GEMMA4_CLOSE in template:
        return GEMMA4_OPEN, GEMMA4_CLOSE
    return None


def thinks(template: str | None) -> bool:
    return thought_tags(template) is not None


def opened_by_prompt(prompt_text: str, tags: tuple[str, str] = (OPEN, CLOSE)) -> bool:
    """True when the rendered prompt ends inside an open thought (DeepSeek-R1's generation
    prompt opens it; Qwen3's with thinking off writes an empty, closed one)."""
    return prompt_text.rfind(tags[0]) > prompt_text.rfind(tags[1])


@dataclass(frozen=True)
class ReasoningPlan:
    """How a request's output is split: `inside` when generation starts inside the thought,
    which the template's `open` ... `close` marks wrap."""

    inside: bool
    open: str = OPEN
    close: str = CLOSE


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
        self.open, self.close = plan.open, plan.close
        self.state = "inside" if plan.inside else "start"
        self.pending = ""
        self.opened = False  # the model opened a thought itself (an empty one counts)

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.pending += delta
        reasoning, answer = "", ""
        while True:
            if self.state == "start":  # outside, before any answer: a thought may open
                stripped = self.pending.lstrip()
                if stripped.startswith(self.open):
                    self.pending = stripped[len(self.open) :]
                    self.state, self.opened = "inside", True
                    continue
                if self.open.startswith(stripped) and not finished:
                    break  # whitespace or a prefix of the tag so far: wait
                self.state = "answer"
                continue
            if self.state == "inside":
                end = self.pending.find(self.close)
                if end >= 0:
                    reasoning += self.pending[:end]
                    self.pending = self.pending[end + len(self.close) :]
                    self.state = "closed"
                    continue
                keep = 0 if finished else _held(self.pending, self.close)
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
