"""An optional disk tier under the host tier: one file per block, named by its hash, with a
header carrying a fingerprint of everything that shapes KV bytes (model, dtype, block size,
layout) and a digest of the block's bytes. A restarted server with the same fingerprint starts
warm; a file written for another model/config/format is skipped with a warning, never loaded.

Bytes read back from disk are not trusted: a bit flip, a truncated file, a torn write or a file
renamed to another block's hash fails the digest (blake2b over the header, the block hash and
the payload), and the block is a miss (recomputed), the file removed, the failure counted
(`integrity_failures`, on /metrics). A save that fails (disk full, read-only directory) is
logged, counted (`save_failures`) and dropped: the tier is a cache, never a reason to fail a
step."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from pathlib import Path

import torch

from engine.kv.sparse_log import should_log

log = logging.getLogger("kvserve.disk_tier")
# v2: a payload digest after the size. v1 files (no digest) read as "written for another
# format": skipped, and replaced when the block is saved again.
MAGIC = b"KVSB2\x00"
DIGEST_BYTES = 16  # blake2b-128: catches corruption; the disk is not an adversary here


class DiskTier:
    def __init__(
        self,
        path: str,
        fingerprint: str,
        shapes: list[tuple[torch.Size, torch.dtype]],
        max_bytes: int,
    ) -> None:
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = hashlib.sha256(fingerprint.encode()).digest()
        self.shapes = shapes
        self.payload_bytes = sum(
            int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for s, d in shapes
        )
        self.max_bytes = max_bytes
        # Block hashes chain from a random root; a warm restart must reuse this cache's root, so
        # it lives beside the blocks (random per cache directory, never predictable).
        seed_file = self.root / "root.seed"
        if not seed_file.is_file() or seed_file.stat().st_size != 32:
            seed_file.write_bytes(os.urandom(32))
        self.root_seed = seed_file.read_bytes()
        self.hits = 0
        self.rejected = 0  # files for another model, config or format (expected after a change)
        self.integrity_failures = 0  # files whose bytes failed the check (never served)
        self.save_failures = 0  # saves the filesystem refused (disk full, read-only)
        # a *.tmp is a write that never reached its os.replace (the process was killed
        # mid-write): never a block, only wasted space
        for stale in self.root.glob("*.tmp"):
            try:
                stale.unlink()
            except OSError:
                pass
        # hashes on disk, oldest first (by mtime), so a bounded disk evicts the oldest files
        files = sorted(self.root.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        self.files: dict[bytes, Path] = {}
        for p in files:
            try:
                self.files[bytes.fromhex(p.stem)] = p
            except ValueError:
                continue

    def _header(self) -> bytes:
        return MAGIC + self.fingerprint + struct.pack("<Q", self.payload_bytes)

    def _digest(self, header: bytes, block_hash: bytes, payload: memoryview) -> bytes:
        """The block hash is digested too: a file copied or renamed to another block's name
        fails, instead of serving one prefix's KV for another (`save` digests the same bytes
        part by part)."""
        h = hashlib.blake2b(header, digest_size=DIGEST_BYTES)
        h.update(block_hash)
        h.update(payload)
        return h.digest()

    def describe(self) -> str:
        """The banner's words: where, how big, what a restart finds, and that reads are checked."""
        return (
            f"{self.root}, up to {self.max_bytes / 2**30:.1f} GiB, {len(self.files)} blocks "
            f"found; every read checked against its blake2b digest"
        )

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.files

    def save(self, block_hash: bytes, tensors: list[torch.Tensor]) -> bool:
        """Write one block; False (logged, counted) if the filesystem refused it. Never raises
        for I/O: it runs inside engine steps (host-tier eviction) and at shutdown."""
        if block_hash in self.files:
            return True
        path = self.root / f"{block_hash.hex()}.kv"
        tmp = path.with_suffix(".tmp")
        try:
            while self.files and (len(self.files) + 1) * self.payload_bytes > self.max_bytes:
                oldest = next(iter(self.files))
                self.files.pop(oldest).unlink(missing_ok=True)
            parts = [t.detach().contiguous().cpu().view(torch.uint8).numpy() for t in tensors]
            header = self._header()
            digest = hashlib.blake2b(header, digest_size=DIGEST_BYTES)
            digest.update(block_hash)
            for part in parts:
                digest.update(part)
            # written whole to a temporary name, then renamed: a reader never meets a half
            # file under a block's name. No fsync (a block is cheap to recompute): after a
            # power loss the renamed file may hold anything, and the digest refuses it.
            with open(tmp, "wb") as f:
                f.write(header + digest.digest())
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except OSError as e:
            self.save_failures += 1
            if should_log(self.save_failures):
                log.warning(
                    "disk KV tier: saving a block to %s failed (%s); %d saves failed so far, "
                    "those blocks will be recomputed",
                    self.root,
                    e,
                    self.save_failures,
                )
            _remove(tmp)
            return False
        self.files[block_hash] = path
        return True

    def _refuse(self, block_hash: bytes, path: Path, why: str) -> None:
        """A file whose bytes are not this block's: never served, removed so it is not read
        again (a later save writes the block afresh), counted."""
        self.files.pop(block_hash, None)
        self.integrity_failures += 1
        log.warning(
            "disk KV block %s is %s; skipped and removed (%d such blocks so far)",
            path.name,
            why,
            self.integrity_failures,
        )
        _remove(path)

    def load(self, block_hash: bytes) -> list[torch.Tensor] | None:
        path = self.files.get(block_hash)
        if path is None:
            return None
        try:
            data = path.read_bytes()
        except OSError as e:
            self._refuse(block_hash, path, f"unreadable ({e})")
            return None
        header = self._header()
        if data[: len(MAGIC)] != MAGIC or data[len(MAGIC) : len(MAGIC) + 32] != self.fingerprint:
            # another format version or another model/config: not corrupt, just not ours. Left
            # in place (another configuration may read it); a save of this block replaces it.
            why = "another format" if data[: len(MAGIC)] != MAGIC else "another model or config"
            log.warning("disk KV block %s was written for %s; skipped", path.name, why)
            self.files.pop(block_hash, None)
            self.rejected += 1
            return None
        start = len(header) + DIGEST_BYTES
        if not data.startswith(header) or len(data) != start + self.payload_bytes:
            self._refuse(block_hash, path, f"truncated or of the wrong size ({len(data)} bytes)")
            return None
        payload = memoryview(data)[start:]
        if self._digest(header, block_hash, payload) != data[len(header) : start]:
            self._refuse(block_hash, path, "corrupt (its digest does not match its bytes)")
            return None
        out, offset = [], 0
        for shape, dtype in self.shapes:
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            raw = torch.frombuffer(bytearray(payload[offset : offset + n]), dtype=torch.uint8)
            out.append(raw.view(dtype).reshape(shape))
            offset += n
        self.hits += 1
        return out


def _remove(path: Path) -> None:
    """Remove a file the tier gives up on; one it cannot remove is left (a later save of the
    block replaces it, and a read checks its bytes)."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
