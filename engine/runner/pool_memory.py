"""The engine's host memory: the KV pool kept out of forked children (`pool_zeros`) and
freed step buffers kept for reuse (`keep_freed_memory`).

Why: the server forks its grammar-trial workers (engine/grammar/budget.py) after the pool exists.
A forked child shares every page copy-on-write, so each page the engine then writes for the first
time (a fresh KV block) faulted and was copied: ~8,500 faults, one per 4 KiB, in every 1,500-token
prefill served, until the whole pool had been written once (perf: 61% of the server's page faults
in the KV write). No child reads the pool, so its pages are simply not inherited
(MADV_DONTFORK), and the engine writes them in place.

A step's buffers (a 1,024-token chunk's activations: megabytes each) are freed and allocated
again every step. glibc returned them to the kernel (an allocation above its mmap threshold is
unmapped when freed; a thread arena's heap is trimmed) and the next step faulted them in again,
zero-filled: with the pool fixed, ~20,000 faults a 1,500-token prefill remained, in oneDNN's
GEMMs writing their outputs. With the threshold at its maximum and no trimming they stay
mapped: ~200-1,700 faults, and that prefill served in 1.18-1.22 s instead of 1.21-1.35 s (Zen 4).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
import warnings

import torch

# mallopt parameters (malloc.h) and values: the threshold's maximum on 64-bit (HEAP_MAX_SIZE / 2)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
KEPT = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20))


@functools.cache
def keep_freed_memory() -> bool:
    """Tune glibc's malloc, once per process, to keep what the engine frees mapped for its next
    step (the module docstring); False where this is not glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(mallopt(param, value) == 1 for param, value in KEPT)


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in an anonymous mapping of its own, marked MADV_DONTFORK (Linux) and
    paged in now. A mapping of its own: malloc may place a storage in its heap beside other
    blocks, whose pages a child's malloc walks (a grammar worker died of excluded heap pages)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes)
    region.madvise(mmap.MADV_DONTFORK)
    with warnings.catch_warnings():  # frombuffer warns of nothing that applies to a mapping
        warnings.simplefilter("ignore")
        tensor = torch.frombuffer(region, dtype=dtype).view(shape)  # holds `region`
    return tensor.zero_()
