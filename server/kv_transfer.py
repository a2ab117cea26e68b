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
`both` does either when `kv_transfer_params` asks. This module speaks the protocol and counts
the metrics; the store itself is the engine's remote tier (engine/kv/remote.py), reached only
through the door (`AsyncEngine.prefetch` / `publish`, a request's `export_kv` flag).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine
from engine.core.images import PromptImage
from server.errors import APIError
from server.metrics import Metrics

log = logging.getLogger("kvserve.kv_transfer")


@dataclass(frozen=True, slots=True)
class TransferDirections:
    """What one request's KV hand-over does: fetch its prompt's blocks from the store before
    admission (a decode instance), publish them when it ends (a prefill instance)."""

    fetch: bool = False
    publish: bool = False


NO_TRANSFER = TransferDirections()


class KVTransfer:
    def __init__(self, role: str, url: str, ttl_s: int, metrics: Metrics, secret: str = "") -> None:
        self.role = role
        self.url = url
        self.ttl_s = ttl_s
        self.secret = secret  # kv_store_key: authenticates the store's values (remote.py)
        self.metrics = metrics
        self.engine_id = uuid.uuid4().hex  # names this instance in the params it returns

    # ---- what a request asks for ------------------------------------------------------------

    def directions(self, params: dict[str, Any] | None) -> TransferDirections:
        """Which transfers a request makes, by this instance's role and its `kv_transfer_params`.
        A request that asks for a transfer this instance cannot do is a 400 (it would otherwise
        run without the transfer it named)."""
        wants = params is not None and (
            params.get("do_remote_decode") or params.get("do_remote_prefill")
        )
        if wants and not self.url:
            raise APIError(
                400,
                "kv_transfer_params asks for a KV transfer, but this server has no KV store "
                "(start it with --kv-store-url)",
                param="kv_transfer_params",
            )
        if not self.url:
            return NO_TRANSFER
        return TransferDirections(
            fetch=self.role == "decode" or bool(params and params.get("do_remote_prefill")),
            publish=self.role == "prefill" or bool(params and params.get("do_remote_decode")),
        )

    # ---- decode side --------------------------------------------------------------------------

    async def fetch(
        self,
        engine: AsyncEngine,
        prompt_ids: list[int],
        cache_salt: str | None,
        params: dict[str, Any] | None,
        images: tuple[PromptImage, ...] = (),
    ) -> int:
        """Bring the prompt's published blocks this instance lacks into its host tier, before
        the request is admitted (`images`: the prompt's, whose content hashes key the blocks
        that hold them). Returns the tokens received. Never raises for the store."""
        engine.open_remote(self.url, self.ttl_s, self.secret)
        sent = _published(params)
        if sent is not None and sent.get("namespace") not in (
            None,
            engine.info.kv_namespace.decode(),
        ):
            log.warning(
                "kv transfer: the prefill instance's blocks are for another model or layout; "
                "computing the prompt here"
            )
            self.metrics.kv_fallbacks.labels("other_model").inc()
            return 0
        got = await engine.prefetch(
            prompt_ids,
            cache_salt,
            None if sent is None else sent["num_blocks"],
            None if sent is None else sent.get("last_block_hash"),
            images,
        )
        for reason in got.fallbacks:
            self.metrics.kv_fallbacks.labels(reason).inc()
        self.metrics.collector.remote_integrity_failures += got.refused
        if got.stored < got.wanted:
            self.metrics.kv_store_misses.inc(got.wanted - got.stored)
        tokens = got.stored * engine.info.block_size
        if got.wanted and "store_error" not in got.fallbacks:
            self.metrics.kv_received_tokens.observe(tokens)
            self.metrics.kv_received_bytes.observe(got.nbytes)
            self.metrics.kv_receive_seconds.observe(got.seconds)
        return tokens

    # ---- prefill side -------------------------------------------------------------------------

    async def publish(
        self, engine: AsyncEngine, blocks: list[tuple[bytes, bytes]]
    ) -> dict[str, Any]:
        """Put a finished prompt's full blocks (exported by the engine in the step that ended
        it) in the store; the params the decode instance gets (through the router) say how
        many and which chain they end."""
        engine.open_remote(self.url, self.ttl_s, self.secret)
        t = time.monotonic()
        if blocks and not await engine.publish(blocks):
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
