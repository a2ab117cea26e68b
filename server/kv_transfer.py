"""Prefill/decode disaggregation, the worker side of vllm-router's PD protocol.

The router sends a request first to a prefill instance with `max_tokens=1` and
`kv_transfer_params.do_remote_decode`; that instance computes the prompt, publishes its full
KV blocks to the remote store (keyed by prefix-cache block hash) and answers with a top-level
`kv_transfer_params` that the router copies, verbatim, into the same request sent to a decode
instance. The decode instance fetches the run of the prompt's blocks the store holds into its
host tier before admitting the request, so its prefix-cache lookup meets them there
(device -> host -> remote -> compute); whatever it cannot fetch (store down, blocks evicted,
another hash root) it computes itself. Slower, never lost.

Roles: `prefill` publishes every request's prompt; `decode` fetches for every request;
`both` does either when `kv_transfer_params` asks. The store's I/O runs in worker threads;
the engine is touched only through its door (a request's `export_kv` flag, `import_blocks`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from engine.async_engine import AsyncEngine
from engine.kv_store import KVStoreError, RedisBlockStore
from server.errors import APIError
from server.metrics import Metrics

log = logging.getLogger("kvserve.kv_transfer")


class KVTransfer:
    def __init__(self, role: str, url: str, ttl_s: int, metrics: Metrics) -> None:
        self.role = role
        self.url = url
        self.ttl_s = ttl_s
        self.metrics = metrics
        self.engine_id = uuid.uuid4().hex  # names this instance in the params it returns
        self._store: RedisBlockStore | None = None

    def store(self, engine: AsyncEngine) -> RedisBlockStore | None:
        if self._store is None and self.url:
            info = engine.info
            self._store = RedisBlockStore(
                self.url, info.kv_namespace, info.host_block_bytes, self.ttl_s
            )
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    # ---- what a request asks for ------------------------------------------------------------

    def check(self, params: dict[str, Any] | None) -> None:
        """A request that asks for a transfer this instance cannot do is a 400 (the request
        would otherwise run without the transfer it named)."""
        if params is None:
            return
        wants = params.get("do_remote_decode") or params.get("do_remote_prefill")
        if wants and not self.url:
            raise APIError(
                400,
                "kv_transfer_params asks for a KV transfer, but this server has no KV store "
                "(start it with --kv-store-url)",
                param="kv_transfer_params",
            )

    def publishes(self, params: dict[str, Any] | None) -> bool:
        return bool(self.url) and (
            self.role == "prefill" or bool(params and params.get("do_remote_decode"))
        )

    def fetches(self, params: dict[str, Any] | None) -> bool:
        return bool(self.url) and (
            self.role == "decode" or bool(params and params.get("do_remote_prefill"))
        )

    # ---- decode side --------------------------------------------------------------------------

    async def fetch(
        self,
        engine: AsyncEngine,
        prompt_ids: list[int],
        cache_salt: str | None,
        params: dict[str, Any] | None,
    ) -> int:
        """Bring the prompt's published blocks this instance lacks into its host tier, before
        the request is admitted. Returns the tokens received. Never raises for the store."""
        store = self.store(engine)
        assert store is not None
        bs = engine.info.block_size
        # the last prompt token is always recomputed (the request needs its logits)
        hashes = engine.block_hashes(prompt_ids, cache_salt)[: (len(prompt_ids) - 1) // bs]
        sent = _published(params)
        expected = len(hashes) if sent is None else min(len(hashes), sent["num_blocks"])
        ours = engine.info.kv_namespace.decode()
        if sent is not None and sent.get("namespace") not in (None, ours):
            log.warning(
                "kv transfer: the prefill instance's blocks are for another model or layout; "
                "computing the prompt here"
            )
            self.metrics.kv_fallbacks.labels("other_model").inc()
            return 0
        if sent is not None and expected and sent.get("last_block_hash"):
            if hashes[expected - 1].hex() != sent["last_block_hash"]:
                log.warning(
                    "kv transfer: the prefill instance's block hashes differ from ours "
                    "(another kv_hash_seed or tokenization?); computing the prompt here"
                )
                self.metrics.kv_fallbacks.labels("hash_mismatch").inc()
                return 0
        if expected < len(hashes) and sent is not None:
            # the prefill instance published less than the prompt (its store put failed, or
            # it held fewer blocks): the rest is computed here
            self.metrics.kv_fallbacks.labels("not_published").inc()
        have = engine.num_cached_prefix(hashes[:expected])
        wanted = hashes[have:expected]
        if not wanted:
            return 0
        t = time.monotonic()
        try:
            payloads = await asyncio.to_thread(store.get_run, wanted)
        except KVStoreError as e:
            log.warning("kv transfer: %s; computing the prompt here", e)
            self.metrics.kv_fallbacks.labels("store_error").inc()
            return 0
        stored = await engine.import_blocks(list(zip(wanted, payloads, strict=False)))
        seconds = time.monotonic() - t
        missing = len(wanted) - stored
        if missing:
            self.metrics.kv_store_misses.inc(missing)
            self.metrics.kv_fallbacks.labels("missing_blocks").inc()
        tokens = stored * bs
        self.metrics.kv_received_tokens.observe(tokens)
        self.metrics.kv_received_bytes.observe(sum(len(p) for p in payloads[:stored]))
        self.metrics.kv_receive_seconds.observe(seconds)
        return tokens

    # ---- prefill side -------------------------------------------------------------------------

    async def publish(
        self, engine: AsyncEngine, blocks: list[tuple[bytes, bytes]]
    ) -> dict[str, Any]:
        """Put a finished prompt's full blocks (exported by the engine in the step that ended
        it) in the store; the params the decode instance gets (through the router) say how
        many and which chain they end."""
        store = self.store(engine)
        assert store is not None
        t = time.monotonic()
        try:
            await asyncio.to_thread(store.put, blocks)
        except KVStoreError as e:
            log.warning("kv transfer: %s; the decode instance will compute the prompt", e)
            self.metrics.kv_publish_failures.inc()
            blocks = []
        self.metrics.kv_published_blocks.inc(len(blocks))
        self.metrics.kv_publish_seconds.observe(time.monotonic() - t)
        return {
            # vLLM's field names, so routers that read them see a decode-ready answer
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            "kvserve": {
                "num_blocks": len(blocks),
                "block_size": engine.info.block_size,
                "num_tokens": len(blocks) * engine.info.block_size,
                "last_block_hash": blocks[-1][0].hex() if blocks else None,
                "namespace": engine.info.kv_namespace.decode(),
            },
        }


def _published(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The kvserve part of a prefill instance's params, if it is well-formed."""
    sent = (params or {}).get("kvserve")
    if not isinstance(sent, dict) or not isinstance(sent.get("num_blocks"), int):
        return None
    return sent
