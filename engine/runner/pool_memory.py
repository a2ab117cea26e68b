"""The engine's host memory: the KV pool kept out of forked children (`exclude_from_forks`) and
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
import mmap
import sys

import torch

MADV_DONTFORK = 10  # linux/mman.h
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


@functools.cache
def _madvise():  # noqa: ANN202 (a ctypes function)
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def exclude_from_forks(tensor: torch.Tensor) -> int:
    """Mark the whole pages under a CPU tensor's storage MADV_DONTFORK (Linux); returns the bytes
    marked (0 elsewhere, on a device, or where the kernel refuses: nothing else changes)."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return 0
    page = mmap.PAGESIZE
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return 0
    if _madvise()(first, last - first, MADV_DONTFORK) != 0:
        return 0
    return last - first
