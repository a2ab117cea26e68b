"""The host-memory KV tier: a second block pool in CPU memory (pinned on CUDA), keyed by the same
block hashes as the device prefix cache and bounded in bytes, LRU.

Blocks arrive on eviction from the device pool (write-back), on preemption by swap, and when an
idle session is offloaded; a new request whose prefix continues here gets them copied back into
fresh device blocks instead of recomputing them. Copies are batched per call: one index_select /
index_copy per KV group. Blocks evicted from here go to the optional disk tier.

Every block crosses between the device and the (pinned) host storage in one copy: saving gathers
the blocks on the device into one contiguous tensor and copies runs of it straight into
consecutive storage slots; loading copies runs of consecutive storage slots straight to the
device and scatters them there. No pageable temporary stands between the two (an `index_select`
of host storage, or a `.to("cpu")`, would make one, and the DMA would be staged through it). On
CUDA the copies are asynchronous; `_sync` waits for them before the host itself reads or writes
the storage (the disk tier, `load_from_disk`).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from engine.kv.disk import DiskTier

# upper bounds (seconds) of the swap-in latency histogram's buckets
SWAP_IN_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


def pin_with_cuda(buffer: torch.Tensor) -> None:
    """Page-lock `buffer`'s memory for asynchronous copies (cudaHostRegister): exactly its
    bytes, where torch's pinned allocator rounds each allocation up to a power of two (a 24
    GiB tier would pin 32). Unregistered never: the tier lives as long as the engine."""
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of the host KV tier ({buffer.numel()} bytes) failed: {err}"
        )


def host_storage(
    shapes: list[tuple[int, ...]],
    dtypes: list[torch.dtype],
    pin: bool,
    pin_memory: Callable[[torch.Tensor], None] = pin_with_cuda,
) -> tuple[list[torch.Tensor], int]:
    """One tensor per KV group, all views of one allocation of exactly their bytes (each
    group's start aligned to 64), and that size. Zeroed here so the pages are resident from the
    start: the tier's memory is reserved at startup (an over-sized --host-bytes fails now, not
    mid-run), and the process's RSS stays flat while the tier fills instead of looking like a
    leak. `pin`: registered with CUDA for asynchronous copies."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // 64) * 64
    buffer = torch.zeros(total, dtype=torch.uint8)
    if pin and total:
        pin_memory(buffer)
    views = [
        buffer[start : start + size].view(dtype).view(shape)
        for start, size, shape, dtype in zip(starts, sizes, shapes, dtypes, strict=True)
    ]
    return views, total


class HostTier:
    def __init__(
        self,
        device_caches: list[torch.Tensor],
        block_dim: int,
        capacity_bytes: int,
        disk: DiskTier | None = None,
        num_blocks: int | None = None,
        mirror: Callable[[str, list[int], list[int]], None] | None = None,
    ) -> None:
        """`num_blocks` overrides the count `capacity_bytes` gives (tensor parallelism: every
        rank holds the same slots, each of its own shard's size); `mirror(direction, a, b)`
        tells the other ranks each copy ("out": device blocks a into slots b; "in": slots a
        into device blocks b), so every rank copies its own shard."""
        self.device_caches = device_caches
        self.block_dim = block_dim
        shapes = [c.shape[:block_dim] + c.shape[block_dim + 1 :] for c in device_caches]
        self.block_bytes = sum(
            c.element_size() * c.numel() // c.shape[block_dim] for c in device_caches
        )
        self.num_blocks = max(0, capacity_bytes // self.block_bytes) if self.block_bytes else 0
        if num_blocks is not None:
            self.num_blocks = num_blocks
        self.mirror = mirror
        pin = bool(device_caches) and device_caches[0].is_cuda
        self.storage, self.allocated_bytes = host_storage(
            [(self.num_blocks, *s) for s in shapes], [c.dtype for c in device_caches], pin
        )
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self.free_slots = list(range(self.num_blocks - 1, -1, -1))
        self.disk = disk
        # blocks imported from the remote store and not yet copied to the device: a hit on one
        # is counted as a remote-tier hit
        self.remote: set[bytes] = set()
        self.saved_blocks = 0
        self.loaded_blocks = 0
        self.evicted_blocks = 0
        self.load_seconds = 0.0
        # swap-in copy latencies as a histogram (counts per bucket of SWAP_IN_BUCKETS, the
        # last one past them): a snapshot copies it, nothing drains it
        self.load_latency_counts = [0] * (len(SWAP_IN_BUCKETS) + 1)
        # CUDA <-> pinned copies run asynchronously on the KV device's current stream (not the
        # process's current device: with --device cuda:1 that is another GPU's stream)
        self._async = pin
        self.kv_device = device_caches[0].device if device_caches else torch.device("cpu")
        self._pending: torch.cuda.Event | None = None
        self._timed_copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _after_copies(self) -> None:
        if self._async:
            self._pending = torch.cuda.Event()
            self._pending.record(torch.cuda.current_stream(self.kv_device))

    def _sync(self) -> None:
        """Wait for in-flight copies to or from the storage before the host touches it."""
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None

    def describe(self) -> str:
        pinned = ", page-locked for CUDA copies" if self._async else ""
        return f"{self.num_blocks} blocks in {self.allocated_bytes / 2**20:.1f} MiB{pinned}"

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def save(self, pairs: Sequence[tuple[bytes, int]], protect: Iterable[bytes] = ()) -> int:
        """Copy device blocks (hash, device block id) here; returns how many were stored."""
        if self.num_blocks == 0:
            return 0
        protected = set(protect)
        new = [(h, b) for h, b in dict(pairs).items() if h not in self.index]
        for h, _ in pairs:
            if h in self.index:
                self.index.move_to_end(h)
        new = new[-self.num_blocks :]  # more than fits: keep the latest
        slots: list[int] = []
        for h, _ in new:
            slot = self._take_slot(protected)
            if slot is None:
                break
            self.index[h] = slot
            slots.append(slot)
        new = new[: len(slots)]
        if not new:
            return 0
        self.copy_out([b for _, b in new], slots)
        self.saved_blocks += len(new)
        return len(new)

    def copy_out(self, device_blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Device blocks into storage slots, pairwise. Under tensor parallelism rank 0 decides
        and every rank copies its own shard (`mirror`)."""
        if self.mirror is not None:
            self.mirror("out", list(device_blocks), list(slots))
        order = sorted(range(len(slots)), key=slots.__getitem__)  # storage order: long runs
        src = torch.tensor([device_blocks[i] for i in order], device=self.device_caches[0].device)
        runs = _runs([slots[i] for i in order])
        for cache, store in zip(self.device_caches, self.storage, strict=True):
            # one gather on the device (a new tensor: the source blocks may be reused at once),
            # then each run of consecutive slots in one copy into the pinned storage
            blocks = cache.index_select(self.block_dim, src).movedim(self.block_dim, 0)
            for start, first, n in runs:
                store[first : first + n].copy_(blocks[start : start + n], non_blocking=self._async)
        self._after_copies()

    def _take_slot(self, protected: set[bytes]) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for victim in self.index:  # oldest first
            if victim not in protected:
                slot = self.index.pop(victim)
                self.evicted_blocks += 1
                if self.disk is not None:
                    self._sync()
                    self.disk.save(victim, [s[slot] for s in self.storage])
                return slot
        return None

    def load(self, hashes: Sequence[bytes], device_blocks: Sequence[int]) -> None:
        """Copy host blocks into the given device blocks (all hashes must be present)."""
        if not hashes:
            return
        self.settle_latencies()
        t = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True) if self._async else None
        if start is not None:
            start.record(torch.cuda.current_stream(self.kv_device))
        self.copy_in([self.index[h] for h in hashes], device_blocks)
        for h in hashes:
            self.index.move_to_end(h)
        self.remote.difference_update(hashes)
        self.loaded_blocks += len(hashes)
        if start is None:
            self._count_latency(time.perf_counter() - t)
        else:  # the copies are in flight: timed on the stream, read once they have completed
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.kv_device))
            self._timed_copies.append((start, end))

    def _count_latency(self, seconds: float) -> None:
        self.load_seconds += seconds
        self.load_latency_counts[bisect.bisect_left(SWAP_IN_BUCKETS, seconds)] += 1

    def settle_latencies(self) -> None:
        """Count the swap-ins whose copies have completed since (CUDA: their time on the
        stream, start to completion; enqueueing them takes microseconds whatever they cost)."""
        while self._timed_copies and self._timed_copies[0][1].query():
            start, end = self._timed_copies.pop(0)
            self._count_latency(start.elapsed_time(end) / 1000)

    def _whole_blocks_only(self) -> None:
        """Blocks as bytes (disk, remote store) are whole; under tensor parallelism this rank
        holds a shard of each (the builder refuses those tiers; this guards the engine API)."""
        if self.mirror is not None:
            raise RuntimeError(
                "KV blocks cannot cross the host tier as bytes under tensor parallelism"
            )

    def copy_in(self, slots: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Storage slots into device blocks, pairwise (mirrored like `copy_out`)."""
        if self.mirror is not None:
            self.mirror("in", list(slots), list(device_blocks))
        order = sorted(range(len(slots)), key=slots.__getitem__)
        runs = _runs([slots[i] for i in order])
        device = self.device_caches[0].device
        dst = torch.tensor([device_blocks[i] for i in order], device=device)
        for cache, store in zip(self.device_caches, self.storage, strict=True):
            # each run of consecutive slots straight from the pinned storage to the device
            parts = [
                store[first : first + n].to(device, non_blocking=self._async)
                for _, first, n in runs
            ]
            blocks = parts[0] if len(parts) == 1 else torch.cat(parts)
            cache.index_copy_(self.block_dim, dst, blocks.movedim(0, self.block_dim))
        self._after_copies()

    def load_from_disk(self, block_hash: bytes) -> bool:
        """Bring one block from the disk tier into this tier (it then loads like any host hit)."""
        if self.disk is None or self.num_blocks == 0:
            return False
        tensors = self.disk.load(block_hash)
        return tensors is not None and self._store_block(block_hash, tensors, set())

    def _store_block(
        self, block_hash: bytes, tensors: Sequence[torch.Tensor], protect: set[bytes]
    ) -> bool:
        """A block arriving from below (disk tier, remote store), one tensor per KV group,
        into a free or evicted slot; False if every slot is protected."""
        self._whole_blocks_only()
        slot = self._take_slot(protect)
        if slot is None:
            return False
        self._sync()  # an in-flight copy may still read this slot
        for store, t in zip(self.storage, tensors, strict=True):
            store[slot].copy_(t)
        self.index[block_hash] = slot
        return True

    def device_payloads(self, block_ids: Sequence[int]) -> list[bytes]:
        """Device blocks as raw bytes, each block's KV groups one after another: the remote
        store's value format (`insert_payload` reads it back)."""
        self._whole_blocks_only()
        if not block_ids:
            return []
        idx = torch.tensor(list(block_ids), device=self.device_caches[0].device)
        parts = [
            cache.index_select(self.block_dim, idx)
            .movedim(self.block_dim, 0)
            .contiguous()
            .cpu()
            .view(torch.uint8)
            .reshape(len(block_ids), -1)
            for cache in self.device_caches
        ]
        rows = torch.cat(parts, dim=1).numpy()
        return [row.tobytes() for row in rows]

    def payload(self, block_hash: bytes) -> bytes | None:
        """A block held here, in `device_payloads`' format."""
        self._whole_blocks_only()
        slot = self.index.get(block_hash)
        if slot is None:
            return None
        self._sync()
        return b"".join(s[slot].view(torch.uint8).numpy().tobytes() for s in self.storage)

    def insert_payload(self, block_hash: bytes, payload: bytes, protect: set[bytes]) -> bool:
        """Store a block received from the remote store (see `device_payloads`); a request
        that continues it then loads it like any host hit. False if it cannot be stored."""
        if len(payload) != self.block_bytes or self.num_blocks == 0:
            return False
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return True
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        tensors, offset = [], 0
        for store in self.storage:
            n = store[0].numel() * store.element_size()
            tensors.append(src[offset : offset + n].view(store.dtype).reshape(store.shape[1:]))
            offset += n
        if not self._store_block(block_hash, tensors, protect):
            return False
        self.remote.add(block_hash)
        return True

    def flush_to_disk(self, device_pairs: Sequence[tuple[bytes, int]] = ()) -> int:
        """Clean shutdown: persist this tier and the device pool's cached blocks to disk.
        Returns the blocks on disk; a save the filesystem refuses is counted by the disk tier,
        never raised (a full disk must not turn a clean shutdown into a crash)."""
        if self.disk is None:
            return 0
        self._sync()
        saved = 0
        for h, slot in self.index.items():
            saved += self.disk.save(h, [s[slot] for s in self.storage])
        for h, block_id in device_pairs:
            saved += self.disk.save(
                h, [c.select(self.block_dim, block_id) for c in self.device_caches]
            )
        return saved


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Sorted storage slots as runs of consecutive ones: (index into `slots`, first slot,
    length)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs
