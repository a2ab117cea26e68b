"""The remote KV tier: full KV blocks in a Redis/Valkey server, keyed by prefix-cache block hash.

Prefill instances put the blocks they computed; decode instances get the run of a prompt's
blocks that the store holds and compute the rest. Keys are namespaced by a fingerprint of
everything that shapes a block's bytes (model weights, dtype, layout, block size), so instances
of another model or configuration sharing the server never read each other's blocks. Values are
the block's raw bytes (`HostTier.device_payloads`); a value of the wrong length is a miss.

Every failure (server down, timeout, eviction) is a miss or a failed put, never an error for
the request: the caller computes what it could not get. Thread-safe (redis-py's connection pool);
called from worker threads, never from the engine thread or the event loop. `AsyncEngine`
holds the store and is the only way to it (`prefetch`, `publish`): a `Prefetch` says what one
prefetch brought and, in `fallbacks`, why any of the prompt will be computed here instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import redis


class KVStoreError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Prefetch:
    """What one prefetch brought into the host tier: the blocks it asked the store for, how many
    it stored (a leading run), their bytes and the seconds it took; `fallbacks` name why part
    of the prompt is computed here (`hash_mismatch`, `not_published`, `store_error`,
    `missing_blocks`)."""

    wanted: int = 0
    stored: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    fallbacks: tuple[str, ...] = ()


class RedisBlockStore:
    def __init__(
        self,
        url: str,
        namespace: bytes,
        block_bytes: int,
        ttl_s: int = 3600,
        timeout_s: float = 2.0,
    ) -> None:
        if urlparse(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"kv_store_url {url!r}: expected redis://HOST:PORT[/DB]")
        self.url = url
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 1.0)
        )

    def key(self, block_hash: bytes) -> bytes:
        return b"kvserve:" + self.namespace + b":" + block_hash

    def put(self, blocks: Sequence[tuple[bytes, bytes]]) -> None:
        """Store (hash, payload) pairs, one pipelined round trip. Raises KVStoreError."""
        if not blocks:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash, payload in blocks:
                pipe.set(self.key(block_hash), payload, ex=self.ttl_s or None)
            pipe.execute()
        except redis.RedisError as e:
            raise KVStoreError(f"put to {self.url} failed: {e}") from e

    def get_run(self, hashes: Sequence[bytes], batch: int = 8) -> list[bytes]:
        """The payloads of the longest leading run of `hashes` that the store holds (a prefix
        is only useful up to its first gap). Pipelined in small batches, so a miss early in a
        long prompt does not fetch the rest. Raises KVStoreError."""
        out: list[bytes] = []
        try:
            for start in range(0, len(hashes), batch):
                pipe = self.client.pipeline(transaction=False)
                for block_hash in hashes[start : start + batch]:
                    pipe.get(self.key(block_hash))
                for value in pipe.execute():
                    if value is None or len(value) != self.block_bytes:
                        return out
                    out.append(value)
        except redis.RedisError as e:
            raise KVStoreError(f"get from {self.url} failed: {e}") from e
        return out

    def close(self) -> None:
        self.client.close()
