"""Prefix-cache block hashes, in one place: H(parent, tokens of the block, extra keys).

The chain starts at a root seed: random per process (so hashes cannot be predicted across
runs), or the disk tier's stored seed (a warm restart must meet its own hashes again). A
request's `cache_salt` enters the first block's extra keys, so every block of a salted prompt
differs from the same tokens under another salt (tenant isolation). A block that holds an
image's placeholder tokens has that image's content hash among its extra keys (as vLLM's
multimodal hashing does): the same picture is a prefix hit, another one at the same place a
miss.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.images import PromptImage, image_keys


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """sha256 (256 bits, so collisions are not a practical concern). Measured ~40 ns per token
    here (docs/spikes/hash_cost.py)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00extra\x00" + extra)
    return h.digest()


def extra_keys(
    cache_salt: str | None,
    index: int,
    images: Sequence[PromptImage] = (),
    block_size: int = 0,
) -> bytes:
    """Extra keys of block `index`: the salt enters the first block (and through the chain,
    every later one); the images whose tokens the block holds enter it (`block_size` tokens a
    block)."""
    salt = cache_salt.encode() if (index == 0 and cache_salt) else b""
    if not images:
        return salt
    return salt + image_keys(images, index * block_size, (index + 1) * block_size)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Everything the pool keeps about a cached block's identity."""

    block_hash: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    extra: bytes


@dataclass(slots=True)
class BlockHasher:
    block_size: int
    root: bytes = field(default_factory=lambda: os.urandom(32))

    def parent(self, hashes: Sequence[bytes], index: int) -> bytes:
        return hashes[index - 1] if index else self.root

    def extend(
        self,
        hashes: list[bytes],
        token_ids: Sequence[int],
        cache_salt: str | None,
        images: Sequence[PromptImage] = (),
    ) -> None:
        """Append the hashes of every full block of `token_ids` not yet in `hashes`."""
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(token_ids):
            i = len(hashes)
            hashes.append(
                hash_block(
                    self.parent(hashes, i),
                    token_ids[i * bs : (i + 1) * bs],
                    extra_keys(cache_salt, i, images, bs),
                )
            )

    def hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        images: Sequence[PromptImage] = (),
    ) -> list[bytes]:
        out: list[bytes] = []
        self.extend(out, token_ids, cache_salt, images)
        return out

    def key(
        self,
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        cache_salt: str | None,
        index: int,
        images: Sequence[PromptImage] = (),
    ) -> BlockKey:
        """The identity of block `index` of a sequence whose hashes are already extended."""
        bs = self.block_size
        return BlockKey(
            hashes[index],
            self.parent(hashes, index),
            tuple(token_ids[index * bs : (index + 1) * bs]),
            extra_keys(cache_salt, index, images, bs),
        )
