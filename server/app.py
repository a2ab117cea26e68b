"""The Starlette application: middleware (auth, body limit, CORS), routes, lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import AsyncEngine
from engine.grammar.budget import default_workers
from server.config import Config
from server.errors import CLIENT_ERRORS, APIError, error_body, to_api_error
from server.flow.messages_output import error_body as anthropic_error
from server.openapi import build_openapi
from server.response_store import ResponseStore
from server.routes.admin import (
    detokenize,
    get_model,
    health,
    index,
    list_models,
    metrics,
    offload_idle_sessions,
    openapi,
    reset_prefix_cache,
    stats,
    tokenize,
    version,
)
from server.routes.chat import chat_completions
from server.routes.completions import completions
from server.routes.embeddings import embeddings
from server.routes.lora import load_lora_adapter, unload_lora_adapter
from server.routes.messages import count_tokens, create_message
from server.routes.responses import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from server.state import UI_DIR, VERSION, ServerState, log


def _public(path: str) -> bool:
    """Routes served without the API key: liveness and the static page (which asks for the key
    and sends it on every API call)."""
    return path in ("/health", "/") or path.startswith("/ui/")


class GuardMiddleware:
    """API key (constant-time) on every route but /health and preflight; 413 on large bodies."""

    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int) -> None:
        self.app, self.max_body = app, max_body_bytes
        self.keys = [k.strip().encode() for k in api_key.split(",") if k.strip()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v for k, v in scope["headers"]}
        if self.keys and scope["method"] != "OPTIONS" and not _public(scope["path"]):
            auth = headers.get("authorization", b"")
            # Anthropic's clients send `x-api-key` (Claude Code: `Authorization` with
            # ANTHROPIC_AUTH_TOKEN); either is the key
            token = auth[7:] if auth[:7].lower() == b"bearer " else headers.get("x-api-key", b"")
            # compare against every key so the time taken does not say which one nearly matched
            if not sum(hmac.compare_digest(token, key) for key in self.keys):
                message = "Incorrect or missing API key. Pass it as 'Authorization: Bearer <key>'."
                resp = APIError(401, message, code="invalid_api_key").response()
                if scope["path"].startswith("/v1/messages"):
                    resp = JSONResponse(anthropic_error(401, message), status_code=401)
                return await resp(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            resp = APIError(
                413,
                f"request body of {int(length)} bytes exceeds the limit of {self.max_body} bytes",
                code="body_too_large",
            ).response()
            return await resp(scope, receive, send)
        await self.app(scope, receive, send)


async def api_error(request: Request, exc: Exception) -> Response:
    """Every error a route raises reaches the client through this one map."""
    api = to_api_error(exc)
    if api is not None:
        return api.response()
    ref = uuid.uuid4().hex[:12]
    log.exception("request %s failed on %s %s", ref, request.method, request.url.path)
    return APIError(
        500, f"internal error processing the request (request id {ref})", code="internal_error"
    ).response()


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    msg = "route not found" if exc.status_code == 404 else str(exc.detail)
    return JSONResponse(
        error_body(exc.status_code, f"{msg}: {request.method} {request.url.path}"),
        status_code=exc.status_code,
    )


def build_app(
    config: Config,
    engine: AsyncEngine | None = None,
    load: bool = True,
    on_fatal: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[AsyncEngine], None] | None = None,
) -> Starlette:
    """The app. With `engine=None` and `load=True` the engine loads in a background thread at
    startup while /health answers 503; `on_ready` runs once it serves."""
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        state.loop = loop
        cfg = config.server
        state.responses = ResponseStore.for_server(
            cfg.responses_db,
            config.engine.disk_path,
            cfg.responses_max_stored,
            cfg.responses_max_age_s,
        )
        workers = cfg.grammar_compile_workers or default_workers()
        if engine is not None:
            engine.on_death = engine.on_death or on_fatal
            engine.budget_grammar_compiles(cfg.max_grammar_compile_s, workers)
            engine.start(loop)
            state.engine = engine
        elif load:

            def load_engine() -> None:
                try:
                    eng = AsyncEngine.from_config(config.engine)
                    eng.on_death = on_fatal
                except BaseException as e:  # noqa: BLE001
                    if isinstance(e, ValueError):  # a refusal with its reasons: no traceback
                        log.error("cannot serve this configuration: %s", e)
                    else:
                        log.exception("model failed to load")
                    state.load_error = e
                    if on_fatal is not None:
                        on_fatal(e)
                    return

                def ready() -> None:
                    eng.budget_grammar_compiles(cfg.max_grammar_compile_s, workers)
                    state.engine = eng
                    log.info("model loaded: ready")
                    if on_ready is not None:
                        on_ready(eng)

                # this thread loaded the model and now steps it: one thread for all torch work
                eng.run_here(loop, on_ready=ready)

            threading.Thread(target=load_engine, name="kvserve-engine", daemon=True).start()
        offloader = None
        if config.server.idle_seconds > 0:
            offloader = asyncio.create_task(offload_idle_sessions(state))
        yield
        if offloader is not None:
            offloader.cancel()
        if state.engine is not None:
            state.engine.shutdown()
        if state.responses is not None:
            state.responses.close()

    routes = [
        Route("/health", health),
        Route("/", index),
        Mount("/ui", app=StaticFiles(directory=UI_DIR), name="ui"),
        Route("/v1/stats", stats),
        Route("/version", version),
        Route("/openapi.json", openapi),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", get_model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    ]
    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=config.server.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        ),
        Middleware(
            GuardMiddleware,
            api_key=config.server.api_key,
            max_body_bytes=config.server.max_body_bytes,
        ),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: http_error,
            **dict.fromkeys(CLIENT_ERRORS, api_error),
            Exception: api_error,  # a bug: 500 with a reference, logged
        },
    )
    app.state.kv = state
    app.state.openapi = build_openapi(VERSION)
    return app
