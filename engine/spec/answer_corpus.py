"""Corpus drafts: a guess at what comes next from the target's own answers to a broad prompt set,
written offline once per shipped model (`tools/answer_corpus.py`) and indexed as a suffix array.
A model's answers to different questions share their phrasing ("Here are some tips", list
skeletons, code idioms, closing lines); the continuation of the longest n-gram ending a request
that also occurs in the corpus is the guess, verified like any other draft.

Pure helpers over two int32 arrays, memory-mapped at startup: `tokens`, the answers one after
another with SEPARATOR between them, and `suffixes`, the start of every suffix in lexicographic
order (each suffix's first token is gathered into memory once, where every search starts).
`AnswerCorpus.match` is a binary search per n-gram size; `build_suffix_array` is numpy prefix
doubling (O(n log^2 n)).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SEPARATOR = -1  # between answers: no match spans two answers, no continuation crosses one
# n-gram sizes, longest first, and the most drafts a match of that size makes. Measured on the
# default model's greedy answers to held-out prompts against its corpus of training-prompt
# answers (first draft kept: 0.66 after an 8-gram, 0.50 after a 5-gram, 0.38 after a 3-gram,
# with 0.6 tokens kept per 3-gram draft: below what a verify row costs)
NGRAM_SIZES = (8, 5)
MAX_DRAFTS = {8: 1 << 30, 5: 4}
CONTEXT_TOKENS = max(NGRAM_SIZES)  # what `match` reads of a request
MAX_VOTES = 32  # occurrences of a match whose continuations vote on the draft
TOKENS_FILE, SUFFIXES_FILE = "answers.tokens.npy", "answers.suffixes.npy"
MANIFEST_FILE = "answers.json"


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix start positions of `tokens` (int32, SEPARATOR allowed) in lexicographic order,
    a shorter suffix before a longer one it is a prefix of."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64) + 1  # 0: past the end
    step = 1
    while True:
        # ranks order the suffixes by their first `step` tokens, so they are all distinct once
        # 2 * step >= n: this loop returns before step reaches n
        nxt = np.zeros(n, dtype=np.int64)
        nxt[: n - step] = rank[step:]
        order = np.lexsort((nxt, rank))
        key_r, key_n = rank[order], nxt[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.cumsum(np.r_[True, (key_r[1:] != key_r[:-1]) | (key_n[1:] != key_n[:-1])])
        rank = new
        if rank.max() == n:
            return order.astype(np.int32)
        step *= 2


def write_corpus(
    directory: str | os.PathLike, answers: Sequence[Sequence[int]], meta: dict
) -> dict:
    """The answers' tokens and their suffix array as .npy files in `directory`, and a manifest
    (`meta` plus counts). Returns the manifest."""
    flat: list[int] = []
    for answer in answers:
        if answer:
            flat.extend(answer)
            flat.append(SEPARATOR)
    tokens = np.asarray(flat, dtype=np.int32)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / TOKENS_FILE, tokens)
    np.save(out / SUFFIXES_FILE, build_suffix_array(tokens))
    manifest = {**meta, "answers": sum(1 for a in answers if a), "tokens": int(len(tokens))}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


class AnswerCorpus:
    """The corpus of one model's answers, searched by the n-grams that end a request."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, source: str = "") -> None:
        if len(tokens) != len(suffixes):
            raise ValueError("an answer corpus needs one suffix per token")
        self.tokens, self.suffixes, self.source = tokens, suffixes, source
        # each suffix's first token, in suffix-array order: a search starts from its first
        # token's run (one numpy search) instead of the whole array
        self.first_tokens = np.asarray(tokens)[np.asarray(suffixes)]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> AnswerCorpus:
        d = Path(directory)
        tokens = np.load(d / TOKENS_FILE, mmap_mode="r")
        suffixes = np.load(d / SUFFIXES_FILE, mmap_mode="r")
        return cls(tokens, suffixes, os.fspath(d))

    @staticmethod
    def present(directory: str | os.PathLike) -> bool:
        return all(Path(directory, f).is_file() for f in (TOKENS_FILE, SUFFIXES_FILE))

    def __len__(self) -> int:
        return len(self.tokens)

    def describe(self) -> str:
        return f"{len(self)} tokens of answers in {self.source or 'memory'}"

    def _range(self, gram: list[int]) -> tuple[int, int]:
        """The suffix-array rows whose suffixes start with `gram` (lo == hi: none)."""
        n, toks, sa = len(gram), self.tokens, self.suffixes

        def key(row: int) -> list[int]:
            start = int(sa[row])
            return toks[start : start + n].tolist()

        head = np.int32(gram[0])  # the array's own dtype: no converted copy of it per search
        first = np.searchsorted(self.first_tokens, head, side="left")
        last = np.searchsorted(self.first_tokens, head, side="right")
        rows = range(int(first), int(last))
        lo = rows.start + bisect.bisect_left(rows, gram, key=key)
        if lo == rows.stop or key(lo) != gram:
            return lo, lo
        hi = lo + 1
        while hi < rows.stop and hi - lo < MAX_VOTES and key(hi) == gram:
            hi += 1
        return lo, hi

    def match(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """The continuation (at most `max_tokens`) most of the corpus's occurrences of the
        longest n-gram ending `context` agree on, token by token, and that n ([] and 0 when no
        n-gram occurs)."""
        if max_tokens <= 0:
            return [], 0
        for n in NGRAM_SIZES:
            if len(context) < n:
                continue
            limit = min(max_tokens, MAX_DRAFTS[n])
            gram = [int(t) for t in context[-n:]]
            lo, hi = self._range(gram)
            if lo == hi:
                continue
            # where each occurrence continues; they vote token by token, the losers dropped
            starts = np.asarray(self.suffixes[lo:hi], dtype=np.int64) + n
            drafts: list[int] = []
            while len(drafts) < limit:
                starts = starts[starts < len(self.tokens)]
                nxt = np.asarray(self.tokens[starts])
                values, counts = np.unique(nxt[nxt != SEPARATOR], return_counts=True)
                if not len(values):
                    break
                best = int(counts.argmax())
                if 2 * int(counts[best]) <= len(starts) and drafts:  # no majority from here on
                    break
                drafts.append(int(values[best]))
                starts = starts[nxt == values[best]] + 1
            if drafts:
                return drafts, n
        return [], 0
