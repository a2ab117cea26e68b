"""OpenAI's Responses API: POST /v1/responses (whole or as a stream of Responses events), and
the stored responses' GET, DELETE, input_items and cancel.

A request is mapped into the neutral conversation (server/flow/responses_plan.py), served through
the one generation flow and answered in the Responses shape (server/flow/responses_output.py).
With `previous_response_id` the stored conversation is prepended: the client resends nothing,
and since the conversation renders to the same tokens as last turn's prompt + output, its KV is
found by the prefix cache in the device pool, the host tier or the disk tier
(`usage.input_tokens_details.cached_tokens`)."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.errors import APIError
from server.flow.answer import AnswerStream
from server.flow.generation import usage_of
from server.flow.plan import api_key_tag
from server.flow.request_flow import start
from server.flow.responses_items import (
    OutputItems,
    input_items,
    new_id,
)
from server.flow.responses_output import ResponseEvents, response_body, responses_usage
from server.flow.responses_plan import namespaces, refuse_unsupported, responses_plan
from server.protocol.responses import (
    ItemList,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from server.protocol.wire import parse_body, reply
from server.response_store import ResponseStore
from server.state import ServerState


def owner_of(state: ServerState, request: Request) -> str:
    """Who may read a stored response: the API key that created it (all callers are one owner
    when the server has no keys)."""
    return api_key_tag(request) if state.config.server.api_key else ""


def store_of(state: ServerState) -> ResponseStore:
    assert state.responses is not None, "opened by the app's lifespan"
    return state.responses


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body = await parse_body(request, ResponsesRequest, state.config.server.max_body_bytes)
    state.check_model(body.model)
    engine = state.ready_engine()
    store, owner = store_of(state), owner_of(state, request)
    refuse_unsupported(body)
    spaces = namespaces(body)  # a call into one comes back named as the client named it
    history: list[dict[str, Any]] = []
    thread = None  # the stored conversation this response continues
    if body.previous_response_id:
        prev = store.get(owner, body.previous_response_id)
        if prev is None:
            raise APIError(
                404,
                f"previous response {body.previous_response_id!r} not found",
                param="previous_response_id",
                code="response_not_found",
            )
        history, thread = prev.input_items + prev.body["output"], prev.conversation
    assert body.input is not None
    items = history + input_items(body.input)
    resp_id = new_id("resp")
    thread = thread or resp_id
    plan = await responses_plan(
        state, engine, body, items, len(history), resp_id, f"response:{thread}"
    )
    gen = await start(state, engine, request, plan.generation)
    with_logprobs = plan.generation.logprobs is not None
    created = int(time.time())
    summary = body.reasoning is not None and bool(
        body.reasoning.summary or body.reasoning.generate_summary
    )
    sealed = "reasoning.encrypted_content" in (body.include or [])

    def builder() -> OutputItems:
        return OutputItems(engine.tokenizer, plan.answer, with_logprobs, spaces, summary, sealed)

    def finish(output: list[dict[str, Any]], status: str) -> dict[str, Any]:
        thought = "".join(i["content"][0]["text"] for i in output if i["type"] == "reasoning")
        reasoning_tokens = (
            len(engine.tokenizer.encode(thought)) if thought and engine.tokenizer else 0
        )
        usage = responses_usage(
            usage_of(gen.choices, 1),
            engine.info.block_size,
            engine.info.prefix_caching,
            reasoning_tokens,
        )
        final = response_body(
            resp_id, created, body, gen.head["model"], status=status, output=output, usage=usage
        )
        if body.store is not False:
            store.put(owner, thread, final, items)
        return final

    if body.stream:
        answer = AnswerStream(plan.answer)
        return gen.stream(ResponseEvents(builder(), answer, body, resp_id, created, finish))

    def respond(usage: dict) -> Response:
        ch = gen.choices[0]
        out = builder()  # the whole answer: its events in one feed, rendered as a stream's
        out.render(AnswerStream(plan.answer).feed(ch.text, True, ch.finish_reason), ch.logprobs)
        final = finish(out.items, out.status)
        if "kv_transfer_params" in gen.head:  # a prefill instance's answer (P/D)
            final["kv_transfer_params"] = gen.head["kv_transfer_params"]
        return reply(ResponseObject, final)

    return await gen.collect(request, respond)


async def retrieve_response(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise APIError(
            400, "stream: only background responses can be streamed again", param="stream"
        )
    stored = _stored(state, request)
    return reply(ResponseObject, stored.body)


async def delete_response(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    rid = request.path_params["response_id"]
    if not store_of(state).delete(owner_of(state, request), rid):
        raise _missing(rid)
    return reply(ResponseDeleted, {"id": rid, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    _stored(state, request)
    raise APIError(400, "only background responses can be cancelled", code="not_background")


async def list_input_items(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    stored = _stored(state, request)
    q = request.query_params
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise APIError(400, "limit: an integer from 1 to 100", param="limit")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order: asc or desc", param="order")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = q.get("after")
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise APIError(400, f"after: no item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return reply(
        ItemList,
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        },
    )


def _stored(state: ServerState, request: Request) -> Any:
    rid = request.path_params["response_id"]
    stored = store_of(state).get(owner_of(state, request), rid)
    if stored is None:
        raise _missing(rid)
    return stored


def _missing(rid: str) -> APIError:
    return APIError(
        404, f"response {rid!r} not found", param="response_id", code="response_not_found"
    )
