"""OpenAI's Responses API: POST /v1/responses (whole or as a stream of Responses events), and
the stored responses' GET, DELETE, input_items and cancel.

A request is mapped onto a chat-completions request (its items become chat messages; tools,
`tool_choice` and `text.format` go through the same tool plan and grammar engine), so the
template, constraints and sampling are chat's own. With `previous_response_id` the stored
conversation is prepended: the client resends nothing, and since the conversation renders to
the same tokens as last turn's prompt + output, its KV is found by the prefix cache in the
device pool, the host tier or the disk tier (`usage.input_tokens_details.cached_tokens`)."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine
from engine.core.outputs import RequestOutput
from server.errors import APIError
from server.flow.chat_plan import RenderedChat, chat_plan, render_chat
from server.flow.constraints import ToolPlan, tool_plan
from server.flow.generation import Choice, usage_of
from server.flow.request_flow import Generation, api_key_tag, renamed, start
from server.flow.responses_items import (
    OutputItems,
    chat_messages,
    input_items,
    model_function_name,
    new_id,
)
from server.protocol.openai import ChatCompletionRequest
from server.protocol.responses import (
    HOSTED_TOOLS,
    INCLUDE_EMPTY,
    INCLUDE_LOGPROBS,
    REASONING_EFFORTS,
    REASONING_SUMMARIES,
    FunctionTool,
    ItemList,
    ResponseDeleted,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
)
from server.protocol.wire import dump, parse_body, reply
from server.response_store import ResponseStore
from server.state import ServerState

# chat's parameter names as the Responses API spells them, for errors raised by shared code
_PARAM_NAMES = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def owner_of(state: ServerState, request: Request) -> str:
    """Who may read a stored response: the API key that created it (all callers are one owner
    when the server has no keys)."""
    return api_key_tag(request) if state.config.server.api_key else ""


def store_of(state: ServerState) -> ResponseStore:
    assert state.responses is not None, "opened by the app's lifespan"
    return state.responses


def refuse_unsupported(body: ResponsesRequest) -> None:
    def no(param: str, why: str) -> APIError:
        return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")

    if body.background:
        raise no("background", "background responses are not supported; stream instead")
    r = body.reasoning
    if r is not None and r.effort is not None and r.effort not in REASONING_EFFORTS:
        raise no("reasoning.effort", f"one of {', '.join(REASONING_EFFORTS)}")
    for field in ("summary", "generate_summary"):
        value = getattr(r, field, None)
        if value is not None and value not in REASONING_SUMMARIES:
            raise no(f"reasoning.{field}", f"one of {', '.join(REASONING_SUMMARIES)}")
    if body.prompt is not None:
        raise no("prompt", "stored prompt templates are not supported; send input")
    if body.conversation is not None:
        raise no("conversation", "conversations are not supported; use previous_response_id")
    for i, name in enumerate(body.include or []):
        if name != INCLUDE_LOGPROBS and name not in INCLUDE_EMPTY:
            known = ", ".join(sorted({INCLUDE_LOGPROBS, *INCLUDE_EMPTY}))
            raise no(f"include.{i}", f"unknown include {name!r}; one of {known}")
    if body.service_tier not in (None, "auto", "default"):
        raise no("service_tier", "this server has one tier: auto or default")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise no("text.verbosity", "verbosity cannot be steered for this model")
    for i, tool in enumerate(body.tools or []):
        if tool.type == "namespace" and (not tool.name or "." in tool.name):
            raise no(f"tools.{i}.name", "a namespace needs a name without dots")
    for where, _, function in offered_functions(body):
        if function.type != "function":
            raise no(
                f"{where}.type",
                f"{function.type!r} tools are not available; function, namespace and the "
                f"hosted {', '.join(sorted(HOSTED_TOOLS))} (never called here) are",
            )
        if function.name is None:
            raise no(f"{where}.name", "a function tool needs a name")
    choice = body.tool_choice
    if not isinstance(choice, str | None) and (choice.type != "function" or not choice.name):
        raise no("tool_choice", "name a function: {'type': 'function', 'name': ...}")
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema" and fmt.json_schema is None:
        raise APIError(400, "text.format: json_schema needs a schema", param="text.format.schema")
    if body.input is None:
        raise APIError(400, "input is required", param="input")


def offered_functions(
    body: ResponsesRequest,
) -> Iterator[tuple[str, str | None, FunctionTool]]:
    """Each tool the model is offered, with where the client put it and its namespace: the
    top-level tools and each namespace's, hosted tools skipped (HOSTED_TOOLS)."""
    for i, tool in enumerate(body.tools or []):
        if tool.type in HOSTED_TOOLS:
            continue
        if tool.type == "namespace":
            for j, inner in enumerate(tool.tools or []):
                yield f"tools.{i}.tools.{j}", tool.name, inner
        else:
            yield f"tools.{i}", None, tool


def model_functions(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The functions offered to the model, a namespace's flattened as `namespace.name`."""
    functions = []
    for _, namespace, tool in offered_functions(body):
        assert tool.name is not None  # refuse_unsupported
        functions.append(
            tool.model_dump(include={"description", "parameters", "strict"})
            | {"name": model_function_name(namespace, tool.name)}
        )
    return functions


def tool_echo(tool: FunctionTool) -> dict[str, Any]:
    """A tool as the response echoes it (OpenAI's shape: `strict` on functions)."""
    out = tool.model_dump(exclude_none=True)
    if tool.type == "function":
        out["strict"] = tool.strict
    if tool.tools is not None:
        out["tools"] = [tool_echo(t) for t in tool.tools]
    return out


def namespaces(body: ResponsesRequest) -> frozenset[str]:
    return frozenset(t.name for t in body.tools or [] if t.type == "namespace" and t.name)


def reasoning_echo(body: ResponsesRequest) -> dict[str, Any] | None:
    """The request's reasoning settings as OpenAI echoes them (honoured: this model does not
    reason, so no reasoning item follows from them)."""
    r = body.reasoning
    if r is None:
        return None
    return {"effort": r.effort, "summary": r.summary or r.generate_summary}


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    fmt = body.text.format if body.text else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict},
        }
    elif fmt is not None:
        response_format = {"type": fmt.type}
    choice = body.tool_choice
    with_logprobs = INCLUDE_LOGPROBS in (body.include or []) or bool(body.top_logprobs)
    data: dict[str, Any] = {
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "logprobs": with_logprobs,
        "top_logprobs": body.top_logprobs if with_logprobs else None,
        "kv_transfer_params": body.kv_transfer_params,
        "response_format": response_format,
        "parallel_tool_calls": body.parallel_tool_calls,
        "tools": [{"type": "function", "function": function} for function in model_functions(body)]
        or None,
        "tool_choice": (
            choice
            if isinstance(choice, str | None)
            else {"type": "function", "function": {"name": choice.name}}
        ),
    }
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        raise APIError(400, f"input: {e.errors()[0]['msg']}", param="input") from None


def _status(finish_reason: str | None) -> str:
    """A response's (and its last item's) status from how generation ended."""
    return "incomplete" if finish_reason == "length" else "completed"


def response_body(
    resp_id: str,
    created: int,
    body: ResponsesRequest,
    model: str,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    text = {"format": {"type": "text"}}
    if body.text is not None and body.text.format is not None:
        text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
    choice = body.tool_choice
    tool_choice = (
        choice.model_dump() if choice is not None and not isinstance(choice, str) else choice
    )
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": reasoning_echo(body),
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "service_tier": "default",
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": text,
        "tool_choice": tool_choice or "auto",
        "tools": [tool_echo(t) for t in body.tools or []],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "metadata": body.metadata or {},
        "background": False,
        # OpenAI's schema has these as non-null when present
        **({"usage": usage} if usage is not None else {}),
        **({"user": body.user} if body.user is not None else {}),
    }


async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body = await parse_body(request, ResponsesRequest, state.config.server.max_body_bytes)
    state.check_model(body.model)
    engine = state.ready_engine()
    store, owner = store_of(state), owner_of(state, request)
    refuse_unsupported(body)
    history: list[dict[str, Any]] = []
    conversation = None
    if body.previous_response_id:
        prev = store.get(owner, body.previous_response_id)
        if prev is None:
            raise APIError(
                404,
                f"previous response {body.previous_response_id!r} not found",
                param="previous_response_id",
                code="response_not_found",
            )
        history, conversation = prev.input_items + prev.body["output"], prev.conversation
    assert body.input is not None
    items = history + input_items(body.input)
    resp_id = new_id("resp")
    conversation = conversation or resp_id
    try:
        chat, rendered = _render(engine, body, items, len(history))
        session = f"response:{conversation}"
        plan = chat_plan(state, engine, chat, resp_id, session, rendered, _PARAM_NAMES)
    except APIError as e:
        raise renamed(e, _PARAM_NAMES) from None
    gen = await start(state, engine, request, plan.generation)
    with_logprobs = plan.generation.logprobs is not None
    created = int(time.time())
    max_calls = 1 if body.parallel_tool_calls is False else body.max_tool_calls

    def builder() -> OutputItems:
        forced = plan.tools.determined_name if plan.tools is not None else None
        return OutputItems(
            engine.tokenizer, plan.calls_parser, max_calls, with_logprobs, namespaces(body), forced
        )

    def finish(ch: Choice, output: list[dict[str, Any]]) -> dict[str, Any]:
        usage = responses_usage(usage_of(gen.choices, 1), engine.info.block_size,
                                engine.info.prefix_caching)  # fmt: skip
        final = response_body(
            resp_id,
            created,
            body,
            gen.head["model"],
            status=_status(ch.finish_reason),
            output=output,
            usage=usage,
        )
        if body.store is not False:
            store.put(owner, conversation, final, items)
        return final

    if body.stream:
        return gen.stream(ResponseEvents(builder(), body, resp_id, created, finish))

    def respond(usage: dict) -> Response:
        ch = gen.choices[0]
        out = builder()
        out.feed(ch.text, ch.logprobs, True, _status(ch.finish_reason))
        final = finish(ch, out.items)
        if "kv_transfer_params" in gen.head:  # a prefill instance's answer (P/D)
            final["kv_transfer_params"] = gen.head["kv_transfer_params"]
        return reply(ResponseObject, final)

    return await gen.collect(request, respond)


def _render(
    engine: AsyncEngine, body: ResponsesRequest, items: list[dict[str, Any]], num_stored: int
) -> tuple[ChatCompletionRequest, RenderedChat]:
    """The chat request and its prompt; with `truncation: auto`, the oldest items are dropped
    until the prompt leaves room for the output. `items`: the `num_stored` items of the
    previous response, then the client's `input`. The tool plan is made once: it depends on
    the tools, not on the items."""
    room = engine.info.max_model_len - (body.max_output_tokens or 1)
    tools: ToolPlan | None = None
    planned = False
    while True:
        messages, sources = chat_messages(items, body.instructions)
        try:
            chat = chat_request(body, messages)
            if not planned:
                tools, planned = tool_plan(chat), True
            ids = render_chat(engine, chat, tools)
        except APIError as e:
            raise _as_input_error(e, sources, num_stored) from None
        if len(ids) <= room or body.truncation != "auto" or len(items) <= 1:
            return chat, RenderedChat(ids, tools)
        dropped = 1
        while dropped < len(items) - 1 and items[dropped]["type"] != "message":
            dropped += 1  # no orphaned call outputs
        items, num_stored = items[dropped:], num_stored - dropped


def _as_input_error(e: APIError, sources: list[int | None], num_stored: int) -> APIError:
    """An error the chat path raised about `messages[.i...]`, named by what the client sent:
    `input[.k...]`, `instructions`, or `previous_response_id` (a stored item)."""
    match = re.match(r"messages(?:\.(\d+))?", e.param or "")
    if match is None:
        return e
    where = "input"
    if match.group(1) is not None and int(match.group(1)) < len(sources):
        k = sources[int(match.group(1))]
        if k is None:
            where = "instructions"
        elif k < num_stored:
            where = "previous_response_id"
        else:
            where = f"input.{k - num_stored}"
    param = where + (e.param or "")[match.end() :] if where.startswith("input") else where
    e.message = e.message.replace(match.group(0), param, 1)
    e.param = param
    return e


def responses_usage(usage: dict, block_size: int, prefix_caching: bool) -> dict:
    prompt = usage["prompt_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    written = max(0, prompt // block_size * block_size - cached) if prefix_caching else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponseEvents:
    """The Responses API's event stream: created and in_progress, the output items' events as
    text arrives, then completed/incomplete (the stored response) or failed."""

    def __init__(
        self,
        out: OutputItems,
        body: ResponsesRequest,
        resp_id: str,
        created: int,
        finish: Callable[[Choice, list[dict[str, Any]]], dict[str, Any]],
    ) -> None:
        self.out, self.body, self.resp_id, self.created = out, body, resp_id, created
        self.finish = finish
        self.model = ""
        self.seq = itertools.count()

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = dump(ResponseEvent, {"type": kind, "sequence_number": next(self.seq), **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _snapshot(self, status: str, error: dict | None = None) -> dict[str, Any]:
        return response_body(self.resp_id, self.created, self.body, self.model, status=status,
                             output=self.out.items, error=error)  # fmt: skip

    def begin(self, gen: Generation) -> list[bytes]:
        self.model = gen.head["model"]
        return [
            self._event(kind, {"response": self._snapshot("in_progress")})
            for kind in ("response.created", "response.in_progress")
        ]

    def step(self, choice: Choice, out: RequestOutput) -> list[bytes]:
        status = _status(choice.finish_reason)
        feed = self.out.feed(out.new_text, out.logprobs, out.finished, status)
        return [self._event(kind, fields) for kind, fields in feed]

    def end(self, gen: Generation, usage: dict) -> list[bytes]:
        final = self.finish(gen.choices[0], self.out.items)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [self._event(kind, {"response": final})]

    def fail(self, gen: Generation, error: dict) -> list[bytes]:
        return [self._event("response.failed", {"response": self._snapshot("failed", error)})]


async def retrieve_response(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise APIError(400, "stream: only background responses can be streamed again",
                       param="stream")  # fmt: skip
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
    return APIError(404, f"response {rid!r} not found", param="response_id",
                    code="response_not_found")  # fmt: skip
