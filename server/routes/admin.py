"""Everything around generation: health, models, tokenize, metrics, stats, the page, admin."""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from typing import TypeVar

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from engine.async_engine import AsyncEngine
from server.errors import APIError
from server.flow.chat_plan import chat_tools, chat_turns
from server.flow.chat_prompt import render_prompt
from server.flow.conversation import Conversation
from server.protocol.admin import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmptyRequest,
    ModelCard,
    ModelList,
    StatusResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from server.protocol.wire import parse_body, reply
from server.state import UI_DIR, VERSION, ServerState, log


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
        {"status": "ok", "attention_backend": state.engine.info.attention_backend},
    )


async def index(request: Request) -> Response:
    return FileResponse(os.path.join(UI_DIR, "index.html"))


async def stats(request: Request) -> Response:
    """The page's live panel: a snapshot taken between engine steps."""
    state: ServerState = request.app.state.kv
    engine = state.ready_engine()
    snap = await engine.snapshot()
    host = snap.host
    budget = engine.grammar_budget
    return JSONResponse(
        {
            "model": state.model_name,
            "time": time.time(),
            "running": snap.num_running,
            "waiting": snap.num_waiting,
            "generation_tokens": snap.generation_tokens,
            "prompt_tokens": snap.prompt_tokens,
            "prefix_cache_queries": snap.prefix_cache_queries,
            "prefix_cache_hits": snap.prefix_cache_hits,
            "num_blocks": snap.num_blocks,
            "block_size": snap.block_size,
            "blocks_in_use": snap.block_map.count("2"),
            "block_map": snap.block_map,
            "host": None
            if host is None
            else {"used_bytes": host.used_bytes, "capacity_bytes": host.capacity_bytes},
            "apps": state.app_cache.snapshot(),
            "speculation": None
            if snap.spec is None
            else {
                "by_source": {
                    source: {"draft_tokens": drafted, "accepted_tokens": accepted}
                    for source, (drafted, accepted) in snap.spec.by_source.items()
                },
                "recent_requests": list(snap.spec.recent_requests),
            },
            "grammar_compiles": None
            if budget is None
            else {
                "budget_s": budget.budget_s,
                "workers": len(budget.pids),
                "waiting": budget.waiting,
                "over_budget": budget.over_budget,
            },
        }
    )


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


def model_card(state: ServerState, name: str | None = None) -> dict:
    """The base model's card, or (`name`) a LoRA adapter's, with the base as its parent."""
    engine = state.ready_engine()
    created = datetime.datetime.fromtimestamp(state.created, datetime.UTC)
    root, parent = engine.info.model_path, None
    if name is not None and name != state.model_name:
        root, parent = engine.lora_paths.get(name, ""), state.model_name
    model_id = name or state.model_name
    return {
        "id": model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "kvserve",
        "max_model_len": engine.info.max_model_len,
        "type": "model",
        "display_name": model_id,
        "created_at": created.isoformat().replace("+00:00", "Z"),
        "root": root,
        "parent": parent,
    }


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    engine = state.ready_engine()
    cards = [model_card(state)] + [model_card(state, name) for name in engine.loras]
    body = {
        "object": "list",
        "data": cards,
        "has_more": False,
        "first_id": cards[0]["id"],
        "last_id": cards[-1]["id"],
    }
    return reply(ModelList, body)


async def get_model(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    name = request.path_params["model"] or "/"
    state.check_model(name)
    return reply(ModelCard, model_card(state, name))


BodyT = TypeVar("BodyT", TokenizeRequest, DetokenizeRequest)


async def _tokenizer_body(request: Request, model: type[BodyT]) -> tuple[BodyT, AsyncEngine]:
    """The parsed body of a tokenizer route and the engine, once its model and tokenizer check."""
    state: ServerState = request.app.state.kv
    body = await parse_body(request, model, state.config.server.max_body_bytes)
    state.check_model(body.model)
    engine = state.ready_engine()
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return body, engine


async def tokenize(request: Request) -> Response:
    body, engine = await _tokenizer_body(request, TokenizeRequest)
    assert engine.tokenizer is not None
    if body.messages is not None:
        conversation = Conversation(
            chat_turns(body.messages),
            "messages",
            template_kwargs=body.chat_template_kwargs or {},
            add_generation_prompt=body.add_generation_prompt,
        )
        ids = render_prompt(engine.tokenizer, conversation, chat_tools(body.tools, None))
    elif body.prompt is not None:
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise APIError(400, "either prompt or messages is required", param="prompt")
    return reply(
        TokenizeResponse,
        {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_model_len},
    )


async def detokenize(request: Request) -> Response:
    body, engine = await _tokenizer_body(request, DetokenizeRequest)
    assert engine.tokenizer is not None
    vocab = engine.info.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return reply(
        DetokenizeResponse,
        {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)},
    )


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    engine = state.engine
    snap = None
    if engine is not None and engine.dead is None:
        snap = await engine.snapshot()
    return Response(state.metrics.render(snap), media_type=CONTENT_TYPE_LATEST)


async def reset_prefix_cache(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    await parse_body(request, EmptyRequest, state.config.server.max_body_bytes, optional=True)
    ok = await state.ready_engine().reset_prefix_cache()
    if not ok:
        raise APIError(409, "cannot reset the prefix cache while requests run")
    return JSONResponse({"status": "ok"})


async def offload_idle_sessions(state: ServerState) -> None:
    """Move idle sessions' KV to the host tier before the device pool needs their blocks."""
    idle = state.config.server.idle_seconds
    while True:
        await asyncio.sleep(max(0.2, idle / 4))
        engine = state.engine
        if engine is None or engine.dead is not None or not engine.info.has_host_tier:
            continue
        for sid, session in state.sessions.idle(idle):
            moved = await engine.offload_prefix(
                session.token_ids, session.cache_salt, session.images
            )
            session.offloaded = True
            log.debug("session %s idle %.0fs: %d blocks offloaded to host", sid, idle, moved)
