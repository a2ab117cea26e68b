"""Anthropic's Messages API: POST /v1/messages (whole or as Anthropic's event stream) and POST
/v1/messages/count_tokens, for clients such as Claude Code (`ANTHROPIC_BASE_URL`). A request is
mapped into the neutral conversation (server/flow/messages_plan.py), served through the one
generation flow, and answered in Anthropic's shapes (server/flow/messages_output.py), errors
included: `{"type": "error", "error": {"type", "message"}}` on these routes only."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncEngine
from server.errors import CLIENT_ERRORS, to_api_error
from server.flow.answer import Answer
from server.flow.constraints import tool_plan
from server.flow.conversation import Conversation
from server.flow.conversation_plan import render
from server.flow.images import load_images
from server.flow.messages_output import (
    MessagesEvents,
    content_blocks,
    error_body,
    message_body,
    messages_usage,
    stop_reason,
)
from server.flow.messages_plan import messages_conversation, messages_plan
from server.flow.request_flow import start
from server.protocol.anthropic import (
    AnthropicMessage,
    AnthropicTokenCount,
    CountTokensRequest,
    MessagesRequest,
)
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
) -> tuple[ServerState, AsyncEngine, BodyT, Conversation]:
    """Both routes' first steps: the body, the model check, the engine, and the conversation
    the body asks to continue."""
    state: ServerState = request.app.state.kv
    body = await parse_body(request, model, state.config.server.max_body_bytes)
    state.check_model(body.model)
    engine = state.ready_engine()
    return state, engine, body, messages_conversation(body)


@anthropic_errors
async def create_message(request: Request) -> Response:
    state, engine, body, conversation = await _open(request, MessagesRequest)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    plan, cache_control = await messages_plan(state, engine, request, body, conversation, msg_id)
    gen = await start(state, engine, request, plan.generation)
    info = engine.info

    def usage_of(usage: dict) -> dict[str, int]:
        return messages_usage(usage, info.block_size, info.prefix_caching, cache_control)

    stops = body.stop_sequences or []
    omit = body.thinking is not None and body.thinking.display == "omitted"
    if body.stream:
        return gen.stream(MessagesEvents(msg_id, plan.answer, stops, usage_of, omit))

    def respond(usage: dict) -> Response:
        counted = usage_of(usage)
        choice = gen.choices[0]
        answer = Answer.read(plan.answer, choice.text)  # the whole answer: its events folded
        content = content_blocks(answer, omit)
        reason = stop_reason(choice, bool(answer.calls), stops)
        return reply(
            AnthropicMessage, message_body(msg_id, gen.head["model"], content, reason, counted)
        )

    return await gen.collect(request, respond)


@anthropic_errors
async def count_tokens(request: Request) -> Response:
    """The prompt's length as the model's template renders it, tools included."""
    state, engine, _, conversation = await _open(request, CountTokensRequest)
    images = await load_images(state.config.server, engine, conversation)
    ids, _ = render(engine, conversation, tool_plan(conversation), images)
    return reply(AnthropicTokenCount, {"input_tokens": len(ids)})
