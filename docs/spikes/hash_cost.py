"""Per-token cost of the prefix-cache block hash (sha256 over parent + tokens + extra keys).

python docs/spikes/hash_cost.py
"""

from __future__ import annotations

import os
import random
import time

from engine.kv.hashing import hash_block


def main() -> None:
    rng = random.Random(0)
    for block_size in (16, 64):
        blocks = [[rng.randrange(50_000) for _ in range(block_size)] for _ in range(20_000)]
        parent = os.urandom(32)
        t = time.perf_counter()
        for tokens in blocks:
            parent = hash_block(parent, tokens)
        dt = time.perf_counter() - t
        per_token = dt / (len(blocks) * block_size) * 1e9
        print(
            f"block_size {block_size}: {per_token:.0f} ns/token "
            f"({dt / len(blocks) * 1e6:.2f} us/block), 256-bit sha256 chain"
        )


if __name__ == "__main__":
    main()
