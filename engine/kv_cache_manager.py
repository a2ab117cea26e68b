"""Per-request block tables on top of the `BlockPool`, and the prefix-cache walk.

A request's `block_table` covers `num_computed_tokens + num_new_tokens` after each allocation.
Full blocks are registered in the prefix cache under the request's block hashes as soon as the
step that computes them is scheduled (the forward writes every token's KV before any attention of
the same layer reads it, so a block registered this step may be hit by another request this step).
"""

from __future__ import annotations

from engine.block_pool import BlockPool, KVBlock, hash_block
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def update_block_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` to cover every full block of its tokens."""
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else self.pool.root_hash
            salt = request.sampling_params.cache_salt
            extra = salt.encode() if (i == 0 and salt) else b""
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest cached prefix of the request, in whole blocks, leaving at least the last token
        to compute so the request gets logits."""
        if not self.enable_caching or request.num_computed_tokens > 0:
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Grow the request's block table to hold its computed tokens, the prefix hits and
        `num_new_tokens` more. False (and no change) if the pool cannot supply the blocks."""
        computed = computed or []
        table = self.block_tables.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(table) - len(computed)
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            if not table:
                del self.block_tables[request.request_id]
            return False
        self.pool.touch(computed)
        table.extend(computed)
        if need > 0:
            table.extend(self.pool.allocate(need))
        self._num_cached_blocks.setdefault(request.request_id, len(computed))
        if self.enable_caching:
            self._cache_full_blocks(request, total)
        return True

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        self.update_block_hashes(request)
        table = self.block_tables[request.request_id]
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache(table[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
