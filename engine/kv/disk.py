"""An optional disk tier under the host tier: one file per block, named by its hash, with a
header carrying a fingerprint of everything that shapes KV bytes (model, dtype, block size,
layout). A restarted server with the same fingerprint starts warm; a file that is truncated or
was written for another model/config is skipped with a warning, never loaded."""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from pathlib import Path

import torch

log = logging.getLogger("kvserve.disk_tier")
MAGIC = b"KVSB1\x00"


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
        self.rejected = 0
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

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.files

    def save(self, block_hash: bytes, tensors: list[torch.Tensor]) -> None:
        if block_hash in self.files:
            return
        while self.files and (len(self.files) + 1) * self.payload_bytes > self.max_bytes:
            oldest = next(iter(self.files))
            self.files.pop(oldest).unlink(missing_ok=True)
        path = self.root / f"{block_hash.hex()}.kv"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(self._header())
            for t in tensors:
                f.write(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        os.replace(tmp, path)
        self.files[block_hash] = path

    def load(self, block_hash: bytes) -> list[torch.Tensor] | None:
        path = self.files.get(block_hash)
        if path is None:
            return None
        try:
            data = path.read_bytes()
        except OSError as e:
            log.warning("disk KV block %s unreadable (%s); skipped", path.name, e)
            self.files.pop(block_hash, None)
            return None
        header = self._header()
        if not data.startswith(header) or len(data) != len(header) + self.payload_bytes:
            why = (
                "written for another model or config"
                if data[: len(MAGIC)] == MAGIC
                and (data[len(MAGIC) : len(MAGIC) + 32] != self.fingerprint)
                else "truncated or corrupt"
            )
            log.warning("disk KV block %s is %s; skipped", path.name, why)
            self.files.pop(block_hash, None)
            self.rejected += 1
            return None
        out, offset = [], len(header)
        for shape, dtype in self.shapes:
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            raw = torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8)
            out.append(raw.view(dtype).reshape(shape))
            offset += n
        self.hits += 1
        return out
