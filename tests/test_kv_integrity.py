"""KV read back from a tier below the device is checked before it is served (issue #66): the
disk tier's files carry a digest, the remote store's values a tag (HMAC with kv_store_key, else a
digest). A block that fails is a miss, recomputed, never served, and counted on /metrics
(`kvserve:kv_tier_integrity_failures_total{tier=...}`); a save the disk refuses never raises.
Also: `--disk-path` alone brings the host tier the disk tier hangs under."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.kv import disk as disk_module
from engine.kv.disk import DIGEST_BYTES, DiskTier
from harness.cluster import KVStoreProcess, redis_server_bin
from server.__main__ import kv_store_line
from server.config import load_config
from server.kv_transfer import KVTransfer
from server.metrics import Metrics

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SHAPES = [(torch.Size([2, 4, 8]), torch.float32), (torch.Size([3, 5]), torch.bfloat16)]
HEADER = len(disk_module.MAGIC) + 32 + 8  # magic, fingerprint, payload size


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def block(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(d) for s, d in SHAPES]


def tier(path: Path, fingerprint: str = "fp") -> DiskTier:
    return DiskTier(str(path), fingerprint, SHAPES, max_bytes=1 << 20)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# ---- the disk tier, unit ---------------------------------------------------------------------


def test_disk_block_round_trips_and_a_flipped_byte_is_refused(tmp_path: Path) -> None:
    t = tier(tmp_path)
    h = bytes(range(32))
    assert t.save(h, block(1))
    got = t.load(h)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, block(1), strict=True))
    path = tmp_path / f"{h.hex()}.kv"
    flip(path, HEADER + DIGEST_BYTES + 17)  # one byte of the payload
    assert t.load(h) is None
    assert t.integrity_failures == 1 and not t.contains(h)
    assert not path.exists()  # removed: never read again
    assert t.save(h, block(1)) and t.load(h) is not None  # written afresh, served again


@pytest.mark.parametrize(
    "damage",
    ["truncated", "grown", "zeroed_payload", "flipped_digest", "renamed"],
)
def test_damaged_disk_files_are_misses_and_counted(tmp_path: Path, damage: str) -> None:
    t = tier(tmp_path)
    h, other = b"\x01" * 32, b"\x02" * 32
    t.save(h, block(2))
    path = tmp_path / f"{h.hex()}.kv"
    data = path.read_bytes()
    if damage == "truncated":  # a torn write that reached its name (power loss, no fsync)
        path.write_bytes(data[: len(data) // 2])
    elif damage == "grown":
        path.write_bytes(data + b"\x00")
    elif damage == "zeroed_payload":  # the same size, the bytes never written
        path.write_bytes(data[: HEADER + DIGEST_BYTES] + bytes(len(data) - HEADER - DIGEST_BYTES))
    elif damage == "flipped_digest":
        flip(path, HEADER + 3)
    else:  # another block's file under this block's name: its digest names the other hash
        path.unlink()
        t2 = tier(tmp_path / "b")
        t2.save(other, block(3))
        (tmp_path / "b" / f"{other.hex()}.kv").rename(path)
    fresh = tier(tmp_path)  # a restart indexes the directory again
    assert fresh.contains(h)
    assert fresh.load(h) is None
    assert fresh.integrity_failures == 1 and fresh.hits == 0


def test_stale_tmp_file_is_never_served_and_is_cleaned(tmp_path: Path) -> None:
    """A write killed before its rename leaves a .tmp (even a complete one): never a block."""
    t = tier(tmp_path)
    h = b"\x03" * 32
    t.save(h, block(4))
    kv = tmp_path / f"{h.hex()}.kv"
    tmp = kv.with_suffix(".tmp")
    kv.rename(tmp)
    (tmp_path / f"{'04' * 32}.tmp").write_bytes(b"half a block")
    fresh = tier(tmp_path)
    assert not fresh.contains(h) and fresh.load(h) is None
    assert not list(tmp_path.glob("*.tmp"))


def test_old_format_files_are_skipped_not_counted_and_replaced(tmp_path: Path) -> None:
    t = tier(tmp_path)
    h = b"\x05" * 32
    t.save(h, block(5))
    path = tmp_path / f"{h.hex()}.kv"
    data = path.read_bytes()
    # a v1 file: the old magic, no digest
    path.write_bytes(b"KVSB1\x00" + data[len(disk_module.MAGIC) : HEADER] + data[HEADER + 16 :])
    fresh = tier(tmp_path)
    assert fresh.load(h) is None
    assert fresh.rejected == 1 and fresh.integrity_failures == 0
    assert fresh.save(h, block(5)) and fresh.load(h) is not None


def test_failed_saves_never_raise_and_are_counted_and_logged_sparingly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    t = tier(tmp_path)
    tmp_path.chmod(0o555)  # a read-only directory
    if os.geteuid() == 0:  # root writes through file modes: refuse the writes the way EROFS does

        def read_only(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(disk_module, "open", read_only, raising=False)
    try:
        with caplog.at_level(logging.WARNING, logger="kvserve.disk_tier"):
            results = [t.save(bytes([i]) * 32, block(i)) for i in range(5)]
    finally:
        tmp_path.chmod(0o755)
    assert results == [False] * 5
    assert t.save_failures == 5 and not t.files
    assert len(caplog.records) == 3  # the 1st, 2nd and 4th
    assert not list(tmp_path.glob("*.tmp"))


def test_disk_full_save_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = tier(tmp_path)

    def full(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "replace", full)
    assert t.save(b"\x06" * 32, block(6)) is False
    assert t.save_failures == 1 and t.load(b"\x06" * 32) is None
    assert not list(tmp_path.glob("*.tmp"))  # the partial write is not left behind


# ---- the disk tier, through the engine -------------------------------------------------------


def test_a_flipped_block_on_disk_is_recomputed_and_counted(llama_dir, tmp_path: Path) -> None:
    prompt = prompt_ids(100, seed=9)
    disk = tmp_path / "kv"
    kw = dict(num_kv_blocks=64, block_size=8, host_bytes="1MiB", disk_path=str(disk))
    cold = LLM(str(llama_dir), num_kv_blocks=64, block_size=8).generate([prompt], GREEDY)[0]
    first = LLM(str(llama_dir), **kw)
    assert first.generate([prompt], GREEDY)[0].outputs[0].token_ids == cold.outputs[0].token_ids
    first.shutdown()  # clean shutdown flushes the tiers to disk
    del first
    second = LLM(str(llama_dir), **kw)
    hashes = second.engine.kv.hasher.hashes(prompt, None)
    bad = disk / f"{hashes[3].hex()}.kv"
    assert all((disk / f"{h.hex()}.kv").exists() for h in hashes)
    flip(bad, bad.stat().st_size // 2)
    out = second.generate([prompt], GREEDY)[0]
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    # blocks 0-2 came from disk; the walk stopped at the bad block 3, recomputed from there
    assert out.num_cached_tokens == 3 * 8
    assert second.engine.kv.hits_by_source["disk"] == 3 * 8
    assert second.engine.host is not None and second.engine.host.disk is not None
    assert second.engine.host.disk.integrity_failures == 1
    assert not bad.exists()
    snap = second.engine.snapshot()
    assert snap.host is not None and snap.host.disk_integrity_failures == 1
    text = Metrics().render(snap).decode()
    assert 'kvserve:kv_tier_integrity_failures_total{tier="disk"} 1.0' in text
    assert 'kvserve:kv_tier_integrity_failures_total{tier="remote"} 0.0' in text
    assert "kvserve:disk_kv_save_failures_total 0.0" in text


def test_disk_path_alone_brings_a_host_tier_and_a_warm_restart(llama_dir, tmp_path: Path) -> None:
    prompt = prompt_ids(100, seed=11)
    kw = dict(num_kv_blocks=64, block_size=8, disk_path=str(tmp_path / "kv"))  # no host_bytes
    first = LLM(str(llama_dir), **kw)
    host = first.engine.host
    assert host is not None and host.disk is not None and host.num_blocks > 0
    assert "--disk-path without --host-bytes" in first.engine.info.kernel_table
    assert "disk tier:" in first.engine.info.kernel_table
    ref = first.generate([prompt], GREEDY)[0]
    first.shutdown()
    del first, host
    gc.collect()  # the 1 GiB default host tier, before the second one
    second = LLM(str(llama_dir), **kw)
    warm = second.generate([prompt], GREEDY)[0]
    assert warm.num_cached_tokens >= 96
    assert second.engine.kv.hits_by_source["disk"] > 0
    assert warm.outputs[0].token_ids == ref.outputs[0].token_ids


# ---- the remote store: settings and banner ---------------------------------------------------


def test_kv_store_key_setting_and_banner() -> None:
    url = "redis://:secret-pw@127.0.0.1:6379/0"
    plain = load_config(["--kv-store-url", url], env={})
    assert plain.server.kv_store_key == ""
    line = kv_store_line(plain)
    assert "TRUSTED, unauthenticated" in line and "secret-pw" not in line
    keyed = load_config(["--kv-store-url", url], env={"KVSERVE_KV_STORE_KEY": "k1"})
    assert keyed.server.kv_store_key == "k1"
    assert "authenticated (HMAC-SHA256" in kv_store_line(keyed)
    flag = load_config(["--kv-store-url", url, "--kv-store-key", "k2"], env={})
    assert flag.server.kv_store_key == "k2"
    with pytest.raises(SystemExit, match="kv_store_key without kv_store_url"):
        load_config(["--kv-store-key", "k"], env={})


def test_host_tier_bytes_default_follows_the_disk_path() -> None:
    assert EngineConfig().host_tier_bytes() == 0
    assert EngineConfig(disk_path="/x").host_tier_bytes() == 1 << 30
    assert EngineConfig(disk_path="/x", host_bytes="8MiB").host_tier_bytes() == 8 << 20


# ---- the remote store, on a real redis-server ------------------------------------------------

# as in test_disagg.py: scripts/test.sh installs redis-server, and CI fails a run that skips these
needs_redis = pytest.mark.skipif(
    redis_server_bin() is None and not os.environ.get("CI"),
    reason="redis-server not installed (apt-get install redis-server)",
)


@pytest.fixture(scope="module")
def store_url():
    """A redis-server started by harness/cluster.py, stopped by its PID."""
    with KVStoreProcess(maxmemory="64mb") as store:
        yield store.url


def remote(url: str, namespace: bytes, secret: str = "", block_bytes: int = 64):
    from engine.kv.remote import RedisBlockStore

    return RedisBlockStore(url, namespace, block_bytes, ttl_s=60, secret=secret)


HASHES = [bytes([i]) * 32 for i in range(6)]
PAYLOADS = [bytes([i + 1]) * 64 for i in range(6)]


@pytest.mark.slow
@needs_redis
@pytest.mark.parametrize("intruder", ["no key", "another key"])
def test_remote_values_without_the_key_are_refused(store_url: str, intruder: str) -> None:
    ns = f"ns-{intruder}".encode()
    keyed = remote(store_url, ns, "K")
    keyed.put(list(zip(HASHES, PAYLOADS, strict=True)))
    assert keyed.get_run(HASHES) == (PAYLOADS, 0)
    other = remote(store_url, ns, "" if intruder == "no key" else "K2")
    other.put([(HASHES[2], b"\xee" * 64)])  # same namespace and hash, its own (or no) tag
    reader = remote(store_url, ns, "K")
    assert reader.get_run(HASHES) == (PAYLOADS[:2], 1)  # the leading run stops there
    assert reader.integrity_failures == 1
    # and the intruder cannot read the keyed values either
    assert other.get_run(HASHES[:2]) == ([], 1)
    for s in (keyed, other, reader):
        s.close()


@pytest.mark.slow
@needs_redis
def test_remote_flipped_byte_or_moved_value_is_refused(store_url: str) -> None:
    import redis

    raw = redis.Redis.from_url(store_url)
    for secret in ("K", ""):  # the keyless digest catches corruption too
        ns = f"ns-flip-{secret}".encode()
        store = remote(store_url, ns, secret)
        store.put(list(zip(HASHES, PAYLOADS, strict=True)))
        value = bytearray(raw.get(store.key(HASHES[1])))
        value[-5] ^= 0x01
        raw.set(store.key(HASHES[1]), bytes(value))
        assert store.get_run(HASHES) == ([PAYLOADS[0]], 1)
        # a valid value copied under another block's hash: the tag names its own hash
        raw.set(store.key(HASHES[1]), raw.get(store.key(HASHES[4])))
        assert store.get_run(HASHES) == ([PAYLOADS[0]], 1)
        raw.set(store.key(HASHES[1]), b"short")
        assert store.get_run(HASHES) == ([PAYLOADS[0]], 1)
        assert store.integrity_failures == 3
        raw.delete(store.key(HASHES[1]))  # a plain miss is not an integrity failure
        assert store.get_run(HASHES) == ([PAYLOADS[0]], 0)
        assert store.integrity_failures == 3
        store.close()
    raw.close()


@pytest.mark.slow
@needs_redis
def test_a_refused_remote_block_is_a_counted_fallback(llama_dir, store_url: str) -> None:
    """Through the door: the decode side's fetch (server/kv_transfer.py -> AsyncEngine.prefetch)
    stops at the refused block, says why, and /metrics counts it."""
    config = EngineConfig(
        model=str(llama_dir),
        num_kv_blocks=64,
        block_size=8,
        host_bytes="8MiB",
        kv_hash_seed="integrity",
    )
    core = LLMEngine(config)
    engine = AsyncEngine(core)
    metrics = Metrics()
    transfer = KVTransfer("decode", store_url, 60, metrics, secret="K")
    prompt = prompt_ids(41, seed=3)  # 5 full blocks before the last token

    async def main() -> int:
        engine.start(asyncio.get_running_loop())
        try:
            info = engine.info
            hashes = engine._hasher.hashes(prompt, None)[:5]
            zeros = bytes(info.host_block_bytes)
            writer = remote(store_url, info.kv_namespace, "K", info.host_block_bytes)
            writer.put([(h, zeros) for h in hashes])
            intruder = remote(store_url, info.kv_namespace, "", info.host_block_bytes)
            intruder.put([(hashes[2], zeros)])
            writer.close()
            intruder.close()
            tokens = await transfer.fetch(engine, prompt, None, None)
            snapshot = await engine.snapshot()
        finally:
            engine.shutdown()
        text = metrics.render(snapshot).decode()
        assert 'kvserve:kv_tier_integrity_failures_total{tier="remote"} 1.0' in text
        assert 'kvserve:kv_transfer_fallbacks_total{reason="integrity"} 1.0' in text
        return tokens

    assert asyncio.run(main()) == 2 * 8  # blocks 0 and 1; block 2 refused, the run stops
