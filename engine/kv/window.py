"""The KV of sliding-window layers in a block pool of their own, holding only the window.

A layer that attends over the last W tokens never reads a key more than W - 1 positions behind
its first query of a step, so a request needs, of those layers' KV, only the blocks from the one
holding position `first - W + 1` on (Gemma 3's five local layers in six, Mistral's every layer).
The windowed layers' KV groups are allocated with this pool's block count, and each request has a
second block table into it, indexed by the same logical block numbers as its full table; the
blocks behind the window go back to the pool as the request advances, and their entries point at
the pool's null block (block 0, all zeros, never allocated or written: the attention ops skip
blocks outside the window, and the PyTorch paths mask them).

Prefix caching: a windowed block is cached under the same hash as the full block of the same
tokens, and a freed one stays findable until reused (the pool's LRU). A prefix hit of n full
blocks stands only if the window's blocks before the first computed position are all still
cached here; otherwise it shrinks to the longest prefix whose window is (`usable_hit`).
"""

from __future__ import annotations

from engine.kv.hashing import BlockKey
from engine.kv.pool import BlockPool, KVBlock


def first_live_block(first_position: int, window: int, block_size: int) -> int:
    """The first logical block a query at `first_position` (or later) can still read."""
    return max(0, first_position - window + 1) // block_size


def window_pool_blocks(
    max_num_seqs: int, window: int, block_size: int, max_batched_tokens: int, cap: int
) -> int:
    """Blocks the window pool needs so that it rarely limits admission before the full pool:
    every running sequence's window, plus two steps' new tokens (a chunk of a prompt writes all
    of its tokens before any is behind the window, and a request gives the last step's chunk
    back only when it is scheduled again), plus the null block; at most `cap` (the full pool's
    size, null block included: a window pool never holds more than keeping every block would,
    and a startup forward on the full pool's ids must find each of them in the window pool)."""
    per_seq = -(-window // block_size) + 1
    return min(cap, max_num_seqs * per_seq + 2 * -(-max_batched_tokens // block_size) + 1)


class WindowTables:
    def __init__(self, num_blocks: int, block_size: int, window: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, caching, num_reserved=1)
        self.null = self.pool.blocks[0]  # what a freed entry points at
        self.block_size = block_size
        self.window = window
        self.tables: dict[str, list[KVBlock]] = {}
        self.num_reclaimed = 0  # blocks returned behind the window, over the pool's life

    def usable_hit(self, hashes: list[bytes], num_blocks: int) -> list[KVBlock] | None:
        """The cached windowed blocks a prefix hit of `num_blocks` full blocks needs (the
        window before its first computed position), or None if one is gone."""
        first = first_live_block(num_blocks * self.block_size, self.window, self.block_size)
        found = []
        for block_hash in hashes[first:num_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                return None
            found.append(block)
        return found

    def fits(
        self,
        request_id: str,
        first_position: int,
        total_tokens: int,
        hit_blocks: int,
        hit: list[KVBlock],
    ) -> bool:
        """Whether the pool can grow the request's table to `total_tokens` from its first
        uncomputed position `first_position` (a new table after a prefix hit of `hit_blocks`
        full blocks, of which `hit` are the windowed ones), counting the blocks the grow frees
        behind the window first."""
        table = self.tables.get(request_id)
        have = len(table) if table is not None else hit_blocks
        need = -(-total_tokens // self.block_size) - have
        first = first_live_block(first_position, self.window, self.block_size)
        freed = sum(b is not self.null for b in table[:first]) if table is not None else 0
        evictable = sum(1 for b in hit if b.ref_cnt == 0)  # free now, taken by the hit
        return need <= self.pool.num_free_blocks + freed - evictable

    def grow(
        self,
        request_id: str,
        first_position: int,
        total_tokens: int,
        hit_blocks: int = 0,
        hit: list[KVBlock] = (),  # type: ignore[assignment]
    ) -> None:
        """Free what is behind the window of the request's first uncomputed position
        `first_position`, then extend its table to `total_tokens` (a new table starts with a
        prefix hit's `hit_blocks` blocks, `hit` the live ones at their end). The caller checked
        `fits`."""
        table = self.tables.get(request_id)
        if table is None:
            self.pool.touch(hit)
            table = [self.null] * (hit_blocks - len(hit)) + list(hit)
            self.tables[request_id] = table
        self.release(request_id, first_position)
        fresh = -(-total_tokens // self.block_size) - len(table)
        if fresh > 0:
            table.extend(self.pool.allocate(fresh))
            self.pool.evicted.clear()  # no tier behind this pool to write evictions back to

    def release(self, request_id: str, first_position: int) -> None:
        """Give back the request's blocks no query at `first_position` or later can read:
        right after the step that computed past them (the scheduler's update), not at the
        request's next allocation, which a prompt waiting for its next chunk may not get soon."""
        table = self.tables.get(request_id)
        if table is None:
            return
        first = min(first_live_block(first_position, self.window, self.block_size), len(table))
        dead = [b for b in table[:first] if b is not self.null]
        if dead:
            table[:first] = [self.null] * first
            self.pool.free(dead)
            self.num_reclaimed += len(dead)

    def cache(self, request_id: str, index: int, block_hash: bytes, key: BlockKey) -> None:
        """Register the request's windowed block `index` (now full) under its full block's
        hash and key."""
        block = self.tables[request_id][index]
        if block is not self.null:
            self.pool.cache(block, block_hash, key)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self.pool.free(b for b in reversed(table) if b is not self.null)

    def num_live_blocks(self) -> int:
        return sum(sum(b is not self.null for b in t) for t in self.tables.values())
