"""Per-request block tables on top of the `BlockPool`, the prefix-cache walk, and the host tier.

A request's `block_table` covers `num_computed_tokens + num_new_tokens` after each allocation.
Full blocks are registered in the prefix cache under the request's block hashes as soon as the
step that computes them is scheduled (the forward writes every token's KV before any attention of
the same layer reads it, so a block registered this step may be hit by another request this step).

Lookup order for a new request: device pool, then host tier (then disk, through the host tier);
host hits are copied into freshly allocated device blocks during `allocate_slots`, before the
step's forward. Cached blocks evicted from the device pool are written back to the host tier in
the same call, before anything can overwrite them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.core.images import PromptImage
from engine.core.outputs import PrefixSummary
from engine.core.request import Request
from engine.kv.hashing import BlockHasher, BlockKey, extra_keys
from engine.kv.host import HostTier
from engine.kv.pool import BlockPool, KVBlock
from engine.kv.window import WindowTables


@dataclass(slots=True)
class PrefixHit:
    device: list[KVBlock] = field(default_factory=list)
    host: list[bytes] = field(default_factory=list)  # hashes continuing the chain on the host
    num_disk: int = 0  # of the host hits, how many were just read from the disk tier
    num_remote: int = 0  # of the host hits, how many came from the remote store
    # a cached block whose first `partial_len` tokens continue the prefix (then it diverges)
    partial: KVBlock | None = None
    partial_len: int = 0
    # blocks right after the hit that were cached here and evicted since (found in no tier)
    num_evicted: int = 0
    window: list[KVBlock] = field(default_factory=list)  # the hit's live windowed blocks

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size + self.partial_len

    def summary(self, block_size: int) -> PrefixSummary:
        bs = block_size
        return PrefixSummary(
            device=len(self.device) * bs + self.partial_len,
            host=(len(self.host) - self.num_disk - self.num_remote) * bs,
            disk=self.num_disk * bs,
            remote=self.num_remote * bs,
            evicted=max(0, self.num_evicted * bs - self.partial_len),
        )


BlockPrefixCopier = Callable[[int, int, int], None]  # (src block, dst block, num tokens)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        host: HostTier | None = None,
        copy_block_prefix: BlockPrefixCopier | None = None,
        hash_root: bytes | None = None,
        pin_share: float = 0.25,
        window: WindowTables | None = None,
    ) -> None:
        """`window`: the sliding-window layers' own pool (engine/kv/window.py), where the
        builder reclaims their blocks; then there is no host tier and no partial-block copy
        (both move one block id across every KV group)."""
        self.block_size = block_size
        # hash_root: the disk tier's stored seed, so a warm restart meets its own hashes again
        self.hasher = BlockHasher(block_size, *([hash_root] if hash_root else []))
        self.copy_block_prefix = copy_block_prefix
        self.pool = BlockPool(num_blocks, enable_caching, pin_share)
        self.window = window
        assert window is None or (host is None and copy_block_prefix is None)
        self.host = host if enable_caching else None
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found, any tier
        self.hits_by_source = {"device": 0, "host": 0, "disk": 0, "remote": 0}
        # hashes of blocks evicted from the device pool, most recent last (bounded): a lookup
        # that stops at one of them missed because of eviction, not because the prompt differs
        self.recently_evicted: OrderedDict[bytes, None] = OrderedDict()
        self.max_recently_evicted = 8 * num_blocks

    @property
    def scratch_blocks(self) -> int:
        """Blocks a startup forward may write on scratch: ids below this exist in every KV
        group (the window pool is smaller than the full one)."""
        if self.window is None:
            return self.pool.num_blocks
        return min(self.pool.num_blocks, self.window.pool.num_blocks)

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def begin_step(self) -> None:
        self.pool.registered_this_step.clear()
        if self.window is not None:
            self.window.pool.registered_this_step.clear()

    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to cover every full block of its tokens."""
        self.hasher.extend(
            request.block_hashes,
            request.all_token_ids,
            request.sampling_params.cache_namespace,
            request.images,
        )

    def _cache_block(self, request: Request, block: KVBlock, index: int) -> BlockKey:
        key = self.hasher.key(
            request.block_hashes,
            request.all_token_ids,
            request.sampling_params.cache_namespace,
            index,
            request.images,
        )
        self.pool.cache(block, key.block_hash, key)
        return key

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request, in whole blocks, leaving at least the last token
        to compute so the request gets logits. Mean-pooling embedding requests and requests
        that score their prompt take no hits: they need every position's hidden state
        (engine/runner/pooling.py) or logits."""
        hit = PrefixHit()
        if not self.enable_caching or request.num_computed_tokens > 0:
            return hit
        params = request.sampling_params
        if params.pooling == "mean" or params.prompt_logprobs is not None:
            return hit
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.device.append(block)
        if self.host is not None:
            for block_hash in hashes[len(hit.device) :]:
                if self.host.contains(block_hash):
                    hit.host.append(block_hash)
                    hit.num_remote += block_hash in self.host.remote
                elif self.host.load_from_disk(block_hash):
                    hit.host.append(block_hash)
                    hit.num_disk += 1
                else:
                    break
        for block_hash in hashes[hit.num_blocks :]:
            if block_hash not in self.recently_evicted:
                break
            hit.num_evicted += 1
        if self.window is not None:  # the hit stands only as far as its window is cached too
            while hit.device:
                live = self.window.usable_hit(hashes, len(hit.device))
                if live is not None:
                    hit.window = live
                    break
                hit.device.pop()
            return hit
        self._partial_hit(request, hit)
        return hit

    def _partial_hit(self, request: Request, hit: PrefixHit) -> None:
        """Token-granular tail: if the next block is not cached whole, reuse the longest token
        prefix of a cached sibling (copied into the request's own block at allocation)."""
        if self.copy_block_prefix is None:
            return
        bs, j = self.block_size, hit.num_blocks
        limit = min(bs, request.num_tokens - 1 - j * bs)  # the last token is always recomputed
        if limit <= 0:
            return
        parent = self.hasher.parent(request.block_hashes, j)
        tokens = request.all_token_ids[j * bs : j * bs + limit]
        block, n = self.pool.best_partial(
            parent,
            tokens,
            extra_keys(request.sampling_params.cache_namespace, j, request.images, bs),
        )
        if block is not None and n > 0:
            hit.partial, hit.partial_len = block, n

    def record_hit(self, request: Request, hit: PrefixHit) -> None:
        """Count a lookup once, when the request is actually admitted."""
        bs = self.block_size
        self.prefix_queries += request.num_tokens
        self.prefix_hits += hit.num_tokens(bs)
        self.hits_by_source["device"] += len(hit.device) * bs + hit.partial_len
        self.hits_by_source["host"] += (len(hit.host) - hit.num_disk - hit.num_remote) * bs
        self.hits_by_source["remote"] += hit.num_remote * bs
        self.hits_by_source["disk"] += hit.num_disk * bs

    def allocate_slots(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Grow the request's block table to hold its computed tokens, the prefix hits and
        `num_new_tokens` more. False (and no change) if the pool cannot supply the blocks."""
        hit = hit or PrefixHit()
        table = self.block_tables.setdefault(request.request_id, [])
        total = request.num_computed_tokens + hit.num_tokens(self.block_size) + num_new_tokens
        need = -(-total // self.block_size) - len(table) - len(hit.device)
        pinned = hit.device + ([hit.partial] if hit.partial is not None else [])
        evictable_hits = sum(1 for b in pinned if b.ref_cnt == 0)
        first = request.num_computed_tokens + hit.num_tokens(self.block_size)
        fits_window = self.window is None or self.window.fits(
            request.request_id, first, total, len(hit.device), hit.window
        )
        if need > self.pool.num_free_blocks - evictable_hits or not fits_window:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(pinned)  # the partial source too, so this allocation cannot evict it
        table.extend(hit.device)
        fresh = self.pool.allocate(need) if need > 0 else []
        self._write_back(protect=hit.host)
        if hit.host:
            assert self.host is not None
            swapped = fresh[: len(hit.host)]
            self.host.load(hit.host, [b.block_id for b in swapped])
            for k, block in enumerate(swapped):
                self._cache_block(request, block, len(hit.device) + k)
        if hit.partial is not None:
            assert self.copy_block_prefix is not None
            target = fresh[len(hit.host)]
            self.copy_block_prefix(hit.partial.block_id, target.block_id, hit.partial_len)
            self.pool.free([hit.partial])
        table.extend(fresh)
        if self.window is not None:
            self.window.grow(request.request_id, first, total, len(hit.device), hit.window)
        self._num_cached_blocks.setdefault(request.request_id, hit.num_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, total)
        return True

    def _write_back(self, protect: list[bytes] = ()) -> None:  # type: ignore[assignment]
        evicted, self.pool.evicted = self.pool.evicted, []
        if evicted and self.host is not None:
            self.host.save(evicted, protect=protect)
        for block_hash, _ in evicted:
            self.recently_evicted[block_hash] = None
            self.recently_evicted.move_to_end(block_hash)
        while len(self.recently_evicted) > self.max_recently_evicted:
            self.recently_evicted.popitem(last=False)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self.update_block_hashes(request)
        table = self.block_tables[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            key = self._cache_block(request, table[i], i)
            if self.window is not None:
                self.window.cache(request.request_id, i, key.block_hash, key)
        self._num_cached_blocks[request.request_id] = max(start, end)

    def forget_unwritten(self, request: Request) -> None:
        """A request whose step failed: the blocks that step was to fill were registered when it
        was scheduled (above), but their KV may never have been written; they leave the prefix
        cache before the request frees them. Blocks computed in earlier steps stay cached."""
        table = self.block_tables.get(request.request_id, [])
        for block in table[request.num_computed_tokens // self.block_size :]:
            self.pool.forget(block)

    def free(self, request: Request) -> None:
        """Release a request's blocks; a prefix it asked to keep (`SamplingParams.keep_prefix`)
        is pinned in the pool for its time."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        if self.window is not None:
            self.window.free(request.request_id)
        keep = request.sampling_params.keep_prefix
        if keep is not None:
            full = min(keep.num_tokens, request.num_computed_tokens) // self.block_size
            hashes = [b.block_hash for b in table[:full] if b.block_hash is not None]
            self.pool.pin(hashes, keep.ttl_s, keep.app)
        self.pool.free(reversed(table))

    def release_behind_window(self, request: Request) -> None:
        """After a step: the request's windowed blocks its next queries cannot read go back."""
        if self.window is not None:
            self.window.release(request.request_id, request.num_computed_tokens)

    def swap_out(self, request: Request) -> int:
        """Copy the request's computed full blocks to the host tier (preemption by swap)."""
        if self.host is None:
            return 0
        table = self.block_tables.get(request.request_id, [])
        pairs = [
            (b.block_hash, b.block_id)
            for b in table[: request.num_computed_tokens // self.block_size]
            if b.block_hash is not None
        ]
        return self.host.save(pairs)

    def offload_prefix(
        self, token_ids: list[int], cache_salt: str | None, images: Sequence[PromptImage] = ()
    ) -> int:
        """Move a sequence's free cached device blocks to the host tier (idle session offload),
        freeing device blocks before pressure arrives. Blocks in use are left alone."""
        if self.host is None:
            return 0
        blocks = []
        for block_hash in self.hasher.hashes(token_ids, cache_salt, images):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            if block.ref_cnt == 0:
                blocks.append(block)
        self.host.save([(b.block_hash, b.block_id) for b in blocks if b.block_hash])
        moved = 0
        for b in blocks:
            if b.block_hash is not None and self.host.contains(b.block_hash):
                self.pool.uncache(b)
                moved += 1
        return moved

    def export_prompt(self, request: Request) -> list[tuple[bytes, bytes]]:
        """(hash, bytes) of the leading run of a request's full prompt blocks that the device
        pool or the host tier holds: what a prefill instance publishes to the remote store."""
        if self.host is None:
            return []
        self.update_block_hashes(request)
        found: list[tuple[bytes, KVBlock | None]] = []
        for block_hash in request.block_hashes[: request.num_prompt_tokens // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None and not self.host.contains(block_hash):
                break
            found.append((block_hash, block))
        on_device = [b.block_id for _, b in found if b is not None]
        device_bytes = iter(self.host.device_payloads(on_device))
        out = []
        for block_hash, block in found:
            payload = next(device_bytes) if block is not None else self.host.payload(block_hash)
            if payload is None:
                break
            out.append((block_hash, payload))
        return out

    def import_blocks(self, blocks: list[tuple[bytes, bytes]]) -> int:
        """Blocks received from the remote store into the host tier (a request's lookup then
        finds them there); returns how many were stored."""
        if self.host is None:
            return 0
        protect = {h for h, _ in blocks}
        stored = 0
        for block_hash, payload in blocks:
            if not self.host.insert_payload(block_hash, payload, protect):
                break
            stored += 1
        return stored

    def num_cached_prefix(self, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` the device pool or the host tier holds.

        Read from the event loop's side without the engine thread: dict membership is atomic
        under the GIL, and a stale answer only costs a fetch that was not needed, or a block
        computed that could have been fetched (never a wrong result)."""
        n = 0
        for block_hash in hashes:
            if self.pool.lookup(block_hash) is None and not (
                self.host is not None and self.host.contains(block_hash)
            ):
                break
            n += 1
        return n

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        self.recently_evicted.clear()  # dropped on purpose, not evicted
        if self.window is not None and not self.window.pool.reset_prefix_cache():
            return False
        return self.pool.reset_prefix_cache()
