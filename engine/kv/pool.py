"""The physical KV blocks: ref counts, the LRU queue of free blocks and the prefix-cache map.

Invariants (checked by tests/test_block_pool.py):
- a block is in the free queue iff its ref_cnt is 0;
- `cached[h] is b` iff `b.block_hash == h`; a cached block may be free (reusable until allocated);
- allocation takes the least recently freed block and drops its hash (eviction), passing over
  pinned blocks (a prefix a request asked to keep, until its time is up) while unpinned ones
  are free; a pinned block is evicted only when nothing else is free (`pins_broken` counts it).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.kv.hashing import BlockKey


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # set while cached, for token-granular reuse of a partially matching block
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    extra: bytes = b""


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        pin_share: float = 0.25,
        num_reserved: int = 0,
    ) -> None:
        """`num_reserved`: the first blocks are held for good (a window pool's null block)."""
        if num_blocks < 1 + num_reserved:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.num_reserved = num_reserved
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i, ref_cnt=int(i < num_reserved)) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[num_reserved:]
        )
        self.cached: dict[bytes, KVBlock] = {}
        self.children: dict[bytes, dict[int, KVBlock]] = {}  # parent hash -> cached children
        # blocks registered during the current schedule: their KV is written by this step's
        # forward, so they can be shared whole (attention reads after the write) but not copied
        self.registered_this_step: set[int] = set()
        self.num_evictions = 0
        # (hash, block id) of cached blocks evicted by allocate(), drained by the KV manager to
        # write them back to the host tier before the step's forward overwrites them
        self.evicted: list[tuple[bytes, int]] = []
        # pinned prefixes: hash -> when the pin ends (time.monotonic), per application in pin
        # order, each application's bounded to `max_pinned_blocks` (its oldest pins lapse)
        self.pins: dict[bytes, float] = {}
        self.pins_by_app: dict[str, OrderedDict[bytes, None]] = {}
        self.max_pinned_blocks = int(num_blocks * pin_share)  # per application
        self.pins_broken = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (pulling free ones off the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    @property
    def num_pinned(self) -> int:
        now = time.monotonic()
        return sum(1 for until in self.pins.values() if until > now)

    def pin(self, block_hashes: list[bytes], ttl_s: float, app: str) -> None:
        """Keep these cached blocks (a prefix) for `ttl_s` seconds unless the pool would
        otherwise refuse work; an application's pins beyond `max_pinned_blocks` lapse oldest
        first, into ordinary LRU blocks."""
        if self.max_pinned_blocks == 0:
            return
        until = time.monotonic() + ttl_s
        mine = self.pins_by_app.setdefault(app, OrderedDict())
        for h in block_hashes:
            if h in self.cached:
                self.pins[h] = max(self.pins.get(h, 0.0), until)
                mine[h] = None
                mine.move_to_end(h)
        while len(mine) > self.max_pinned_blocks:
            h, _ = mine.popitem(last=False)
            self.pins.pop(h, None)

    def _pinned(self, block: KVBlock, now: float) -> bool:
        h = block.block_hash
        if h is None or h not in self.pins:
            return False
        if self.pins[h] > now:
            return True
        del self.pins[h]  # lapsed
        return False

    def _victims(self, n: int) -> list[KVBlock]:
        """The n free blocks allocation takes: the least recently freed unpinned ones, then (only
        when too few are unpinned) the oldest pinned."""
        if not self.pins:
            return [b for _, b in zip(range(n), self.free_queue.values())]
        now, out, pinned = time.monotonic(), [], []
        for block in self.free_queue.values():
            if len(out) == n:
                break
            (pinned if self._pinned(block, now) else out).append(block)
        broken = pinned[: n - len(out)]
        self.pins_broken += len(broken)
        return out + broken

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise MemoryError(f"need {n} KV blocks, {len(self.free_queue)} free")
        out = []
        for block in self._victims(n):
            del self.free_queue[block.block_id]
            if block.block_hash is not None:
                self.evicted.append((block.block_hash, block.block_id))
                self._forget(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (callers pass tail first so the
        ends of long prefixes are evicted before their shared beginnings)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: bytes, key: BlockKey | None = None) -> None:
        """Register a block under its hash; with its `key` (parent, tokens, extra keys) it can
        also be found by `best_partial`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.registered_this_step.add(block.block_id)
        if key is not None:
            block.parent_hash, block.token_ids, block.extra = key.parent, key.token_ids, key.extra
            self.children.setdefault(key.parent, {})[block.block_id] = block

    def _forget(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        self.pins.pop(block.block_hash, None)
        if block.parent_hash is not None:
            siblings = self.children.get(block.parent_hash, {})
            siblings.pop(block.block_id, None)
            if not siblings:
                self.children.pop(block.parent_hash, None)
        block.block_hash, block.parent_hash, block.token_ids, block.extra = None, None, (), b""

    def best_partial(
        self, parent: bytes, token_ids: list[int], extra: bytes
    ) -> tuple[KVBlock | None, int]:
        """The cached child of `parent` sharing the longest token prefix with `token_ids` (same
        extra keys), and that length. Lets a prompt that diverges mid-block reuse the part of
        the block before the divergence."""
        best, best_len = None, 0
        if not self.enable_caching:
            return best, best_len
        for block in self.children.get(parent, {}).values():
            if block.extra != extra or block.block_id in self.registered_this_step:
                continue
            n = 0
            for a, b in zip(block.token_ids, token_ids):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block, n
        return best, best_len

    def forget(self, block: KVBlock) -> None:
        """Drop a block's hash whatever its references: its KV was never written (the step that
        was to compute it failed), so no lookup may find it."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            self._forget(block)

    def uncache(self, block: KVBlock) -> None:
        """Drop a free block's hash (its KV moved to the host tier) and make it the next block
        allocated, so the device copy is not kept twice."""
        assert block.ref_cnt == 0 and block.block_hash is not None
        self._forget(block)
        self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, since running
        requests would keep registering blocks against a half-cleared map."""
        if len(self.free_queue) != self.num_blocks - self.num_reserved:
            return False
        for block in self.blocks:
            block.block_hash, block.parent_hash, block.token_ids, block.extra = None, None, (), b""
        self.cached.clear()
        self.children.clear()
        self.pins.clear()
        self.pins_by_app.clear()
        return True
