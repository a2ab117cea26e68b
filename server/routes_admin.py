"""Everything around generation: health, models, tokenize, metrics, stats, the page, admin."""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from models.chat_template import TemplateError
from server.errors import APIError
from server.plumbing import (
    UI_DIR,
    VERSION,
    ServerState,
    check_model,
    log,
    parse_body,
    reply,
)
from server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    StatusResponse,
    TokenizeRequest,
    TokenizeResponse,
)

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    if state.load_error is not None:
        return reply(StatusResponse, {"status": "failed", "error": str(state.load_error)}, 503)
    if state.engine is None:
        return reply(StatusResponse, {"status": "loading"}, 503)
    if state.engine.dead is not None:
        return reply(StatusResponse, {"status": "dead", "error": str(state.engine.dead)}, 503)
    if state.draining:
        return reply(StatusResponse, {"status": "draining"}, 503)
    return reply(
        StatusResponse,
        {"status": "ok", "attention_backend": state.engine.engine.backend_cls.name},
    )


async def index(request: Request) -> Response:
    return FileResponse(os.path.join(UI_DIR, "index.html"))


async def stats(request: Request) -> Response:
    """A snapshot for the page's live panel. Read without locking from the engine thread's
    objects: a view may be a step stale, never wrong for long."""
    state: ServerState = request.app.state.kv
    engine = state.ready_engine().engine
    pool, sched = engine.kv.pool, engine.scheduler
    cells = ["2" if b.ref_cnt else ("1" if b.block_hash is not None else "0") for b in pool.blocks]
    host = engine.host
    return JSONResponse(
        {
            "model": state.model_name,
            "time": time.time(),
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "generation_tokens": engine.stats.generation_tokens,
            "prompt_tokens": engine.stats.prompt_tokens,
            "prefix_cache_queries": engine.kv.prefix_queries,
            "prefix_cache_hits": engine.kv.prefix_hits,
            "num_blocks": pool.num_blocks,
            "block_size": engine.block_size,
            "blocks_in_use": cells.count("2"),
            "block_map": "".join(cells),
            "host": None
            if host is None
            else {"used_bytes": host.used_bytes, "capacity_bytes": host.capacity_bytes},
        }
    )


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


def model_card(state: ServerState) -> dict:
    engine = state.ready_engine().engine
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "kvserve",
        "max_model_len": engine.max_model_len,
    }


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    return reply(ModelList, {"object": "list", "data": [model_card(state)]})


async def get_model(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    name = request.path_params["model"]
    if name != state.model_name:
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )
    return reply(ModelCard, model_card(state))


BodyT = TypeVar("BodyT", TokenizeRequest, DetokenizeRequest)


async def _tokenizer_body(request: Request, model: type[BodyT]) -> tuple[BodyT, LLMEngine]:
    """The parsed body of a tokenizer route and the engine, once its model and tokenizer check."""
    state: ServerState = request.app.state.kv
    body = await parse_body(request, model, state.config.server.max_body_bytes)
    check_model(state, body.model)
    engine = state.ready_engine().engine
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return body, engine


async def tokenize(request: Request) -> Response:
    body, engine = await _tokenizer_body(request, TokenizeRequest)
    if body.messages is not None:
        try:
            text = engine.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
            )
        except (TemplateError, ValueError) as e:
            raise APIError(400, str(e), param="messages") from None
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
    elif body.prompt is not None:
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise APIError(400, "either prompt or messages is required", param="prompt")
    return reply(
        TokenizeResponse, {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
    )


async def detokenize(request: Request) -> Response:
    body, engine = await _tokenizer_body(request, DetokenizeRequest)
    vocab = engine.spec.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return reply(
        DetokenizeResponse,
        {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)},
    )


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def reset_prefix_cache(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    ok = await state.ready_engine().call(lambda e: e.reset_prefix_cache())
    if not ok:
        raise APIError(409, "cannot reset the prefix cache while requests run")
    return JSONResponse({"status": "ok"})


async def offload_idle_sessions(state: ServerState) -> None:
    """Move idle sessions' KV to the host tier before the device pool needs their blocks."""
    idle = state.config.server.idle_seconds
    while True:
        await asyncio.sleep(max(0.2, idle / 4))
        engine = state.engine
        if engine is None or engine.dead is not None or engine.engine.host is None:
            continue
        for sid, session in state.sessions.idle(idle):
            ids, salt = session.token_ids, session.cache_salt
            moved = await engine.call(lambda e, ids=ids, salt=salt: e.offload_prefix(ids, salt))
            session.offloaded = True
            log.debug("session %s idle %.0fs: %d blocks offloaded to host", sid, idle, moved)
