"""A request's rotary positions where they are not its token indices: M-RoPE's three axes
(models/mrope.py), computed once from the prompt and its images at admission. A leaf: the
request carries it and the runner reads each step's window of it, so chunked prefill, prefix
hits, preemption (a recompute from index 0) and decode all see the same positions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class RopePositions:
    """`prompt`: [axes, prompt length] positions; a token past the prompt at index i (an
    output, a draft) has position i + `delta` on every axis."""

    prompt: np.ndarray
    delta: int

    def window(self, start: int, end: int) -> np.ndarray:
        """[axes, end - start] positions of token indices [start, end)."""
        n = self.prompt.shape[1]
        head = self.prompt[:, start : min(end, n)]
        if end <= n:
            return head
        tail = np.arange(max(start, n), end, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (self.prompt.shape[0], tail.size))], 1)


def plain_window(axes: int, start: int, end: int) -> np.ndarray:
    """The positions of a request without its own: the token indices on every axis."""
    return np.broadcast_to(np.arange(start, end, dtype=np.int64), (axes, end - start))
