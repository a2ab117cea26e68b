"""The server's state: config, the engine door once it is loaded, metrics, sessions, drain."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from engine.async_engine import AsyncEngine
from engine.core.sampling_params import LoRARef
from server.app_cache import AppCacheStats
from server.config import Config
from server.errors import APIError
from server.kv_transfer import KVTransfer
from server.metrics import Metrics
from server.response_store import ResponseStore
from server.sessions import SessionTracker

VERSION = "0.1.0"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger("kvserve.server")
UI_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui")


class ServerState:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.metrics = Metrics()
        self.app_cache = AppCacheStats(
            self.metrics.registry,
            block_size=lambda: self.engine.info.block_size if self.engine else 16,
            decode=lambda ids: (
                self.engine.tokenizer.decode(ids)
                if self.engine and self.engine.tokenizer
                else " ".join(map(str, ids))
            ),
        )
        self.created = int(time.time())
        self.sessions = SessionTracker()
        self.responses: ResponseStore | None = None  # opened by the app's lifespan
        cfg = config.server
        self.kv_transfer = KVTransfer(
            cfg.role, cfg.kv_store_url, cfg.kv_store_ttl_s, self.metrics, cfg.kv_store_key
        )
        self.draining = False  # SIGTERM received: finish in-flight work, admit nothing new
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def model_name(self) -> str:
        if self.config.server.served_model_name:
            return self.config.server.served_model_name
        if not self.config.engine.model:
            return DEFAULT_MODEL_NAME
        name = os.path.basename(os.path.normpath(self.config.engine.model))
        return name.removesuffix(".gguf")

    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        if self.engine is None:
            raise APIError(503, "the model is still loading", code="model_loading")
        if self.engine.dead is not None:
            raise APIError(
                503, "the engine has failed; the server is restarting", code="engine_dead"
            )
        return self.engine

    def check_model(self, name: str) -> None:
        """The base model's name (or none) or a served LoRA adapter's, else a 404."""
        if (
            name
            and name != self.model_name
            and (self.engine is None or name not in self.engine.loras)
        ):
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def adapter(self, name: str) -> LoRARef | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        if not name or name == self.model_name or self.engine is None:
            return None
        ref = self.engine.loras.get(name)
        if ref is None:  # unloaded since the route checked the name
            self.check_model(name)
        return ref
