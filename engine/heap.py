"""Freed heap memory handed back to the operating system, from the engine thread.

Why: the engine allocates and frees tensors of every size each step (batches change shape), and
glibc keeps freed chunks inside its heaps and arenas for reuse; their fragments rarely coalesce
into the free regions at a heap's top that it returns on its own. Measured with
`bench/soak.py` (32 clients of mixed traffic): the Python heap (tracemalloc) stayed flat
while the process RSS climbed ~40 MB a minute, and the same with MALLOC_ARENA_MAX=2 -- memory
that was freed, not leaked. `malloc_trim(0)` releases the free pages of every arena
(madvise), so RSS follows what is in use. Where libc has no malloc_trim (musl, macOS) this does
nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger("kvserve.heap")


def _malloc_trim():  # -> the C function, or None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """`maybe_trim()` between engine steps: at most once per `interval_s`."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._trim = _malloc_trim() if interval_s > 0 else None
        self._last = time.monotonic()
        self.seconds = 0.0  # spent trimming, for the record

    def maybe_trim(self) -> None:
        if self._trim is None:
            return
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._trim(0)
        self._last = time.monotonic()
        self.seconds += self._last - now
        log.debug("malloc_trim took %.1f ms", (self._last - now) * 1000)
