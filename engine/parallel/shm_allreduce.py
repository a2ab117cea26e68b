"""The all-reduce of CPU tensor parallelism, through shared memory: the ranks are processes of
one host, and gloo's TCP all-reduce cost ~1 ms per call here (two per layer, 60 per SmolLM2
step: half of a decode step, `bench/tensor_parallel.py`); this one costs microseconds.

Each rank copies its partial sum into its own slot of a shared buffer, publishes the call's
sequence number in its own flag, waits until every rank's flag has reached it, then sums the
slots in rank order, so every rank computes the same bits (the residual streams must stay
identical). Two buffers alternate: a rank can only reach call k + 2 after every rank published
call k + 1, which each does only after it has finished reading call k's buffer. Tensors larger
than one slot go through in chunks. x86 keeps stores in program order (TSO), so a flag is never
seen before the data it follows.

A wait that outlasts a lost rank raises instead of spinning forever: `lost()` is checked every
few thousand spins (rank 0: a worker exited; a worker: rank 0 is gone).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

CHUNK = 1 << 18  # float32 elements per rank and round (1 MiB)
FLAG_STRIDE = 8  # int64s between flags: each rank's flag on its own cache line


class ShmAllReduce:
    def __init__(self, rank: int, world: int, name: str | None = None) -> None:
        """Rank 0 creates the segment (name None); the others attach to its `name`."""
        self.rank, self.world = rank, world
        header = world * FLAG_STRIDE * 8
        size = header + 2 * world * CHUNK * 4
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=size)
        if name is not None:
            # the creator owns the segment; Python's resource tracker would unlink it when this
            # process exits (and warn), under a rank that may outlive this one
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.name = self.shm.name
        flags = np.ndarray((world, FLAG_STRIDE), dtype=np.int64, buffer=self.shm.buf)
        self.flags = flags[:, 0]
        if name is None:
            flags[:] = 0
        self.data = torch.frombuffer(
            self.shm.buf, dtype=torch.float32, offset=header, count=2 * world * CHUNK
        ).view(2, world, CHUNK)
        self.seq = 0
        self.lost: Callable[[], str | None] = lambda: None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()  # summed in float32, rounded once
        out = torch.empty_like(flat)
        for start in range(0, flat.numel(), CHUNK):
            n = min(CHUNK, flat.numel() - start)
            self.seq += 1
            slots = self.data[self.seq % 2]
            slots[self.rank, :n].copy_(flat[start : start + n])
            self.flags[self.rank] = self.seq  # publish: the data above is already stored
            self._wait(self.seq)
            torch.sum(slots[:, :n], dim=0, out=out[start : start + n])
        return out.view(x.shape).to(x.dtype)

    def _wait(self, seq: int) -> None:
        flags, spins = self.flags, 0
        while flags.min() < seq:
            spins += 1
            if spins % 4096 == 0:
                why = self.lost()
                if why is not None:
                    raise RuntimeError(f"all-reduce abandoned: {why}")
                os.sched_yield()  # a rank descheduled on a busy host gets the core back
                if spins % (4096 * 64) == 0:
                    time.sleep(0.0005)  # a long wait (another rank's long step): stop burning

    def close(self, unlink: bool) -> None:
        del self.data, self.flags
        try:
            self.shm.close()
        except BufferError:  # a view outlives us (a step that died mid-sum): the OS unmaps
            pass
        if unlink:
            self.shm.unlink()
