"""Anthropic's Messages API: POST /v1/messages (whole or as Anthropic's event stream) and POST
/v1/messages/count_tokens, for clients such as Claude Code (`ANTHROPIC_BASE_URL`). A request is
served as a chat plan (server/flow/messages_plan.py) through the one generation flow, and
answered in Anthropic's shapes (server/flow/messages_output.py), errors included:
`{"type": "error", "error": {"type", "message"}}` on these routes only."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from engine.core.sampling_params import KeepPrefix
from server.errors import CLIENT_ERRORS, APIError, to_api_error
from server.flow.chat_plan import ChatPlan, chat_plan, render_chat
from server.flow.constraints import tool_plan
from server.flow.messages_output import (
    MessagesEvents,
    content_blocks,
    error_body,
    message_body,
    messages_usage,
    stop_reason,
)
from server.flow.messages_plan import (
    PARAM_NAMES,
    as_messages_error,
    breakpoint_of,
    chat_request,
)
from server.flow.plan import app_name, renamed, session_id
from server.flow.request_flow import start
from server.protocol.anthropic import (
    AnthropicMessage,
    AnthropicTokenCount,
    CountTokensRequest,
    MessagesRequest,
)
from server.protocol.openai import ChatCompletionRequest
from server.protocol.wire import parse_body, reply
from server.state import ServerState, log

Handler = Callable[[Request], Awaitable[Response]]


def anthropic_errors(handler: Handler) -> Handler:
    """The route's errors in Anthropic's shape, with the statuses every other route uses."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except CLIENT_ERRORS as e:
            api = to_api_error(e)
            assert api is not None
            # said in the log too: a CLI shows the client's side only when it gives up
            log.info("%s %s: %d %s", request.method, request.url.path, api.status, api.message)
            return JSONResponse(error_body(api.status, api.message), api.status, api.headers)
        except Exception:  # noqa: BLE001 - a bug: a 500 with a reference, logged
            ref = uuid.uuid4().hex[:12]
            log.exception("request %s failed on %s %s", ref, request.method, request.url.path)
            return JSONResponse(error_body(500, f"internal error (request id {ref})"), 500)

    return route


BodyT = TypeVar("BodyT", MessagesRequest, CountTokensRequest)


async def _open(
    request: Request, model: type[BodyT]
) -> tuple[ServerState, AsyncEngine, BodyT, ChatCompletionRequest, list[str]]:
    """Both routes' first steps: the body, the model check, the engine, and the chat request
    the body is served as (with where each of its messages came from)."""
    state: ServerState = request.app.state.kv
    body = await parse_body(request, model, state.config.server.max_body_bytes)
    state.check_model(body.model)
    engine = state.ready_engine()
    try:
        chat, sources = chat_request(body)
    except APIError as e:
        raise renamed(e, PARAM_NAMES) from None
    return state, engine, body, chat, sources


@anthropic_errors
async def create_message(request: Request) -> Response:
    state, engine, body, chat, sources = await _open(request, MessagesRequest)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    user = body.metadata.user_id if body.metadata else None
    try:
        plan = chat_plan(state, engine, chat, msg_id, session_id(request, user),
                         param_names=PARAM_NAMES)  # fmt: skip
    except APIError as e:
        raise renamed(as_messages_error(e, sources), PARAM_NAMES) from None
    mark = breakpoint_of(body, sources)
    generation = plan.generation
    if mark is not None and engine.info.prefix_caching:
        keep = kept_prefix(engine, plan, chat, mark, app_name(request, chat))
        generation = replace(generation, keep_prefix=keep)
    gen = await start(state, engine, request, generation)
    cache_control = mark is not None  # the request marks breakpoints: its usage counts writes
    info = engine.info

    def usage_of(usage: dict) -> dict[str, int]:
        return messages_usage(usage, info.block_size, info.prefix_caching, cache_control)

    stops = body.stop_sequences or []
    omit = body.thinking is not None and body.thinking.display == "omitted"
    if body.stream:
        return gen.stream(MessagesEvents(msg_id, plan, stops, usage_of, omit))

    def respond(usage: dict) -> Response:
        choice = gen.choices[0]
        content = content_blocks(choice, plan, omit)
        reason = stop_reason(choice, any(b["type"] == "tool_use" for b in content), stops)
        body_out = message_body(msg_id, gen.head["model"], content, reason, usage_of(usage))
        return reply(AnthropicMessage, body_out)

    return await gen.collect(request, respond)


def kept_prefix(
    engine: AsyncEngine,
    plan: ChatPlan,
    chat: ChatCompletionRequest,
    mark: tuple[int | None, float],
    app: str,
) -> KeepPrefix:
    """The prompt up to the breakpoint's chat message, in tokens (the conversation rendered up
    to it: templates render a conversation's turns as a prefix of the whole), kept `ttl` s."""
    end, ttl = mark
    num_tokens = len(plan.generation.prompts[0])
    if end is not None:
        upto = chat.model_copy(update={"messages": chat.messages[: end + 1],
                                       "add_generation_prompt": False})  # fmt: skip
        num_tokens = min(num_tokens, len(render_chat(engine, upto, plan.tools)))
    return KeepPrefix(num_tokens, ttl, app)


@anthropic_errors
async def count_tokens(request: Request) -> Response:
    """The prompt's length as the model's template renders it, tools included."""
    _, engine, _, chat, sources = await _open(request, CountTokensRequest)
    try:
        ids = render_chat(engine, chat, tool_plan(chat))
    except APIError as e:
        raise renamed(as_messages_error(e, sources), PARAM_NAMES) from None
    return reply(AnthropicTokenCount, {"input_tokens": len(ids)})
