"""What makes two instances' KV blocks interchangeable: the same weights (by content, not by
path: replicas mount models at different places), dtype, layout and block size, and the same
hash root. The namespace keys the remote store; the root starts every block-hash chain."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_SAMPLE = 1 << 20  # bytes read at the start and the middle of each weight file


def hash_root_from_seed(seed: str) -> bytes:
    """The prefix-cache hash root of every instance configured with `seed` (prefill and decode
    instances sharing a store must meet the same hashes)."""
    return hashlib.sha256(b"kvserve-hash-root\x00" + seed.encode()).digest()


def weights_identity(model_path: str) -> str:
    """A content fingerprint of a checkpoint: each weight file's size and two 1 MiB samples
    (cheap for multi-GB files), plus config.json. Different fine-tunes of one architecture
    differ in their bytes, so their KV never mixes."""
    path = Path(model_path)
    files = (
        [path]
        if path.is_file()
        else sorted(
            p for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin", ".pt")
        )
    )
    h = hashlib.sha256()
    if path.is_dir() and (path / "config.json").is_file():
        h.update((path / "config.json").read_bytes())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE))
            fh.seek(size // 2)
            h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def kv_namespace(model_path: str, **layout: object) -> bytes:
    """16 hex bytes naming this instance's block format in the remote store."""
    blob = json.dumps({"weights": weights_identity(model_path), **layout}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32].encode()
