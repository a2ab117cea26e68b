"""Incremental detokenization and stop strings, one instance per request.

Text is produced from a sliding window of tokens (`prefix_offset`, `read_offset`): decoding
tokens[prefix:] and tokens[prefix:read] and taking the difference keeps sentencepiece's leading
spaces right, and a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until the next
token completes it. While stop strings are set, the last `max(len(stop)) - 1` characters are
held back too, so a stop string split across tokens never reaches the client.
"""

from __future__ import annotations

from models.tokenizer import Tokenizer

_WINDOW = 6  # tokens of left context re-decoded each step


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.sent = 0  # characters of `text` already returned
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def _visible(self, ids: list[int]) -> list[int]:
        if not self.skip_special:
            return ids
        return [i for i in ids if i not in self.tokenizer.special_ids]

    def add(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string matched, if any (text is then truncated)."""
        for token_id in token_ids:
            self.ids.append(token_id)
            before = len(self.text)
            prefix = self.tokenizer.decode(
                self._visible(self.ids[self.prefix_offset : self.read_offset]), False
            )
            full = self.tokenizer.decode(self._visible(self.ids[self.prefix_offset :]), False)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
            if self.stop:
                matched = self._check_stop(max(0, before - self.holdback))
                if matched is not None:
                    return matched
        return None

    def _check_stop(self, start: int) -> str | None:
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                self.sent = min(self.sent, len(self.text))
                return s
        return None

    def flush(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix."""
        end = (
            len(self.text)
            if finished or not self.stop
            else max(self.sent, len(self.text) - self.holdback)
        )
        out = self.text[self.sent : end]
        self.sent = end
        return out
