"""Shared HTTP plumbing: server state, body parsing, response checking through the protocol
models, SSE framing, and the error wrapper every route goes through."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.sampling_params import ParamError
from server.config import Config
from server.errors import APIError
from server.generation import (
    RequestFailed,
    RequestTimeout,
)
from server.metrics import Metrics
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
        self.metrics = Metrics(lambda: self.engine.engine if self.engine else None)
        self.created = int(time.time())
        self.sessions = SessionTracker()
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


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    raw = await request.body()
    if len(raw) > limit:
        raise APIError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_from_loc(err["loc"])
        raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "none"}


def _param_from_loc(loc: tuple) -> str | None:
    """pydantic locations name union members ("prompt", "list[int]", 0); keep the field path."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def check_model(state: ServerState, name: str) -> None:
    if name and name != state.model_name:
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )


def checked(model: type[BaseModel], data: dict) -> dict:
    """Pass a response body through its protocol model: what we send is what we publish."""
    return model.model_validate(data).model_dump(mode="json", exclude_unset=True)


def reply(model: type[BaseModel], data: dict, status: int = 200) -> JSONResponse:
    return JSONResponse(checked(model, data), status_code=status)


def sse(data: dict | str, model: type[BaseModel] | None = None) -> bytes:
    if model is not None and isinstance(data, dict):
        data = checked(model, data)
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def _wrap(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except EngineDeadError as e:
            return APIError(503, str(e), code="engine_dead").response()
        except ParamError as e:
            return APIError(400, str(e), param=e.param).response()
        except RequestTimeout as e:
            return APIError(504, str(e), code="timeout").response()
        except RequestFailed as e:
            return APIError(500, str(e), code="request_failed").response()
        except Exception:
            ref = uuid.uuid4().hex[:12]
            log.exception("request %s failed on %s %s", ref, request.method, request.url.path)
            return APIError(
                500,
                f"internal error processing the request (request id {ref})",
                code="internal_error",
            ).response()

    return run
