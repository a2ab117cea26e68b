"""The KV cache and its tiers, together: the device pool (`pool.py`: blocks, ref counts, LRU,
the prefix-cache map), the prefix hashes (`hashing.py`: root seed, salt, parent chain), the
per-request block tables and the prefix walk over every tier (`manager.py`), the host tier
(`host.py`, pinned memory, with block payloads in the bytes layout every tier shares), the
disk tier (`disk.py`), the remote tier (`remote.py`: a Redis/Valkey store shared by
instances, reached through `AsyncEngine.prefetch` / `publish`), what names a block's bytes
across instances (`identity.py`: the hash root and the content fingerprint), and when a repeated
failure is logged (`sparse_log.py`)."""
