"""The remote KV tier: full KV blocks in a Redis/Valkey server, keyed by prefix-cache block hash.

Prefill instances put the blocks they computed; decode instances get the run of a prompt's
blocks that the store holds and compute the rest. Keys are namespaced by a fingerprint of
everything that shapes a block's bytes (model weights, dtype, layout, block size), so instances
of another model or configuration sharing the server never read each other's blocks. A value is
a tag and the block's raw bytes (`HostTier.device_payloads`).

Values are not trusted. With a shared key (`kv_store_key`) the tag is HMAC-SHA256(key,
namespace, block hash, payload): a value written by a client without the key, replayed under
another hash, or with a flipped byte is refused. Without a key the tag is a plain blake2b digest
of the same: corruption is caught, but anyone who can write to the store can feed every reader
KV (the banner says the store is trusted). A refused value (or one of the wrong length) is a
miss: the leading run stops there, the failure is counted (`integrity_failures`) and logged.

Every failure (server down, timeout, eviction) is a miss or a failed put, never an error for
the request: the caller computes what it could not get. Thread-safe (redis-py's connection pool);
called from worker threads, never from the engine thread or the event loop. `AsyncEngine`
holds the store and is the only way to it (`prefetch`, `publish`): a `Prefetch` says what one
prefetch brought and, in `fallbacks`, why any of the prompt will be computed here instead.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlparse

from engine.kv.sparse_log import should_log

log = logging.getLogger("kvserve.kv_store")
TAG_BYTES = 32  # HMAC-SHA256, with a key
DIGEST_BYTES = 16  # blake2b-128, without one: against corruption only


class KVStoreError(RuntimeError):
    pass


def redacted(url: str) -> str:
    """`url` without its password (redis://:PASSWORD@host): for logs and the banner."""
    parts = urlparse(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


@dataclass(frozen=True, slots=True)
class Prefetch:
    """What one prefetch brought into the host tier: the blocks it asked the store for, how many
    it stored (a leading run), their bytes and the seconds it took; `fallbacks` name why part
    of the prompt is computed here (`hash_mismatch`, `not_published`, `store_error`,
    `missing_blocks`, `integrity`); `refused`: values that failed their tag (counted)."""

    wanted: int = 0
    stored: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    fallbacks: tuple[str, ...] = ()
    refused: int = 0


class Run(NamedTuple):
    """`get_run`'s answer: the payloads of the leading run, and whether the run stopped at a
    value that failed its check (1) rather than at a missing one (0)."""

    payloads: list[bytes]
    refused: int


class RedisBlockStore:
    def __init__(
        self,
        url: str,
        namespace: bytes,
        block_bytes: int,
        ttl_s: int = 3600,
        timeout_s: float = 2.0,
        secret: str | bytes = b"",
    ) -> None:
        """`secret`: the key shared by every instance of the store (`kv_store_key`); empty:
        values carry a plain digest, and the store is trusted."""
        if urlparse(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"kv_store_url {url!r}: expected redis://HOST:PORT[/DB]")
        self.url = url
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.authenticated = bool(self._secret)
        self.tag_bytes = TAG_BYTES if self.authenticated else DIGEST_BYTES
        self.value_bytes = self.tag_bytes + block_bytes
        # worker threads (prefetches) count at once: the lock keeps the count exact
        self._lock = threading.Lock()
        self.integrity_failures = 0
        # imported here, not with the module: the server imports this module on every host,
        # and one without a store (a GPU host's image, the device check) need not have redis
        import redis

        self._errors: Any = redis.RedisError
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 1.0)
        )

    def key(self, block_hash: bytes) -> bytes:
        return b"kvserve:" + self.namespace + b":" + block_hash

    def tag(self, block_hash: bytes, payload: bytes | memoryview) -> bytes:
        """What vouches for `payload` as block `block_hash` of this namespace: an HMAC with the
        key, else a digest. The namespace is length-prefixed so no other (namespace, hash)
        split can give the same bytes: a value copied to another key fails."""
        h: Any = (
            hmac.new(self._secret, digestmod=hashlib.sha256)
            if self.authenticated
            else hashlib.blake2b(digest_size=DIGEST_BYTES)
        )
        h.update(struct.pack("<I", len(self.namespace)))
        h.update(self.namespace)
        h.update(block_hash)
        h.update(payload)
        return h.digest()

    def seal(self, block_hash: bytes, payload: bytes) -> bytes:
        """The stored value: tag, then payload."""
        return self.tag(block_hash, payload) + payload

    def unseal(self, block_hash: bytes, value: bytes) -> bytes | None:
        """The payload of a stored value, or None if it is not this block's (wrong length,
        wrong tag). Constant-time compare: a key's tags must not leak byte by byte."""
        if len(value) != self.value_bytes:
            return None
        payload = memoryview(value)[self.tag_bytes :]
        if not hmac.compare_digest(self.tag(block_hash, payload), value[: self.tag_bytes]):
            return None
        return bytes(payload)

    def _count_refused(self, block_hash: bytes, value: bytes) -> None:
        with self._lock:
            self.integrity_failures += 1
            n = self.integrity_failures
        if should_log(n):
            log.warning(
                "KV store %s: block %s refused (%s; %d values refused so far): %s",
                redacted(self.url),
                block_hash.hex()[:16],
                "wrong length" if len(value) != self.value_bytes else "tag mismatch",
                n,
                "written without this server's kv_store_key, or corrupted"
                if self.authenticated
                else "corrupted",
            )

    def put(self, blocks: Sequence[tuple[bytes, bytes]]) -> None:
        """Store (hash, payload) pairs, one pipelined round trip. Raises KVStoreError."""
        if not blocks:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash, payload in blocks:
                value = self.seal(block_hash, payload)
                pipe.set(self.key(block_hash), value, ex=self.ttl_s or None)
            pipe.execute()
        except self._errors as e:
            raise KVStoreError(f"put to {redacted(self.url)} failed: {e}") from e

    def get_run(self, hashes: Sequence[bytes], batch: int = 8) -> Run:
        """The payloads of the longest leading run of `hashes` that the store holds and that
        pass their check (a prefix is only useful up to its first gap, and a refused block is
        a gap). Pipelined in small batches, so a miss early in a long prompt does not fetch
        the rest. Raises KVStoreError."""
        out: list[bytes] = []
        try:
            for start in range(0, len(hashes), batch):
                chunk = hashes[start : start + batch]
                pipe = self.client.pipeline(transaction=False)
                for block_hash in chunk:
                    pipe.get(self.key(block_hash))
                for block_hash, value in zip(chunk, pipe.execute(), strict=True):
                    if value is None:
                        return Run(out, 0)
                    payload = self.unseal(block_hash, value)
                    if payload is None:
                        self._count_refused(block_hash, value)
                        return Run(out, 1)
                    out.append(payload)
        except self._errors as e:
            raise KVStoreError(f"get from {redacted(self.url)} failed: {e}") from e
        return Run(out, 0)

    def close(self) -> None:
        self.client.close()
