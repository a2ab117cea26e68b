"""Suffix drafts (prompt lookup, as in llama.cpp's lookup decoding and vLLM's `ngram` method):
the tokens that followed the latest earlier occurrence of a sequence's last n tokens are a
guess at what comes next. RAG answers quote their document, code edits copy the file, agents
repeat their tool calls' skeletons; verification keeps only what the target agrees with, so a
wrong guess costs a verify row and nothing else.

Pure helpers: `SuffixIndex` over one growing token list (a request's prompt and output), and
`RecentOutputs`, a bounded index over finished requests' outputs shared by the server.
"""

from __future__ import annotations

from collections import deque

NGRAM_SIZES = (8, 5, 3, 2)  # longest first: a longer match is a better guess


class SuffixIndex:
    """n-gram -> the position right after its latest occurrence, over `tokens` (a list that
    only grows, e.g. a request's `all_token_ids`); indexed lazily up to the last token."""

    __slots__ = ("tokens", "table", "indexed")

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.table: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `table`

    def _catch_up(self, end: int) -> None:
        """Index the n-grams that end at positions [indexed, end) (each has a continuation)."""
        toks, table = self.tokens, self.table
        for stop in range(self.indexed + 1, end + 1):
            for n in NGRAM_SIZES:
                if stop >= n:
                    table[tuple(toks[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)

    def match(self, max_tokens: int) -> tuple[list[int], int]:
        """The continuation (at most `max_tokens`) of the longest n-gram ending the sequence
        that occurred earlier in it, and that n (0 and [] when none did)."""
        toks = self.tokens
        self._catch_up(len(toks) - 1)  # the tail itself must not match itself
        for n in NGRAM_SIZES:
            if len(toks) < n:
                continue
            start = self.table.get(tuple(toks[-n:]))
            if start is not None:
                return toks[start : start + max_tokens], n
        return [], 0


class RecentOutputs:
    """The outputs of recently finished requests, indexed like `SuffixIndex`, at most
    `max_tokens` tokens in all (the oldest output is dropped first)."""

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        self.max_tokens = max_tokens
        self.outputs: deque[tuple[int, list[int]]] = deque()
        self.table: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (output id, next)
        self.by_id: dict[int, list[int]] = {}
        self.num_tokens = 0
        self._next_id = 0

    def add(self, tokens: list[int]) -> None:
        if len(tokens) < 2 or len(tokens) > self.max_tokens:
            return
        oid, self._next_id = self._next_id, self._next_id + 1
        tokens = list(tokens)
        for stop in range(1, len(tokens)):
            for n in NGRAM_SIZES:
                if stop >= n:
                    self.table[tuple(tokens[stop - n : stop])] = (oid, stop)
        self.outputs.append((oid, tokens))
        self.by_id[oid] = tokens
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        oid, tokens = self.outputs.popleft()
        del self.by_id[oid]
        self.num_tokens -= len(tokens)
        for stop in range(1, len(tokens)):
            for n in NGRAM_SIZES:
                key = tuple(tokens[stop - n : stop]) if stop >= n else None
                if key is not None and self.table.get(key, (None,))[0] == oid:
                    del self.table[key]

    def match(self, tail: list[int], max_tokens: int) -> tuple[list[int], int]:
        """Like `SuffixIndex.match` for a sequence ending in `tail`, over the stored outputs."""
        for n in NGRAM_SIZES:
            if len(tail) < n:
                continue
            hit = self.table.get(tuple(tail[-n:]))
            if hit is not None:
                oid, start = hit
                return self.by_id[oid][start : start + max_tokens], n
        return [], 0
