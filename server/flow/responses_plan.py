"""A Responses API request as a chat plan: what it asks that this server refuses (400, naming
the field), the functions it offers the model (namespaces flattened as `namespace.name`, hosted
tools skipped), and its items mapped onto a chat request whose prompt is rendered (and, with
`truncation: auto`, cut from the oldest item) here, so the template, constraints and sampling
are chat's own. Errors the chat path raises about `messages` are named by what the client sent."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from engine.async_engine import AsyncEngine
from server.errors import APIError
from server.flow.chat_plan import RenderedChat, render_chat
from server.flow.constraints import ToolPlan, tool_plan
from server.flow.responses_items import chat_messages, model_function_name
from server.protocol.openai import ChatCompletionRequest
from server.protocol.responses import (
    HOSTED_TOOLS,
    INCLUDE_EMPTY,
    INCLUDE_LOGPROBS,
    REASONING_EFFORTS,
    REASONING_SUMMARIES,
    FunctionTool,
    ResponsesRequest,
)

# chat's parameter names as the Responses API spells them, for errors raised by shared code
PARAM_NAMES = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


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


def namespaces(body: ResponsesRequest) -> frozenset[str]:
    return frozenset(t.name for t in body.tools or [] if t.type == "namespace" and t.name)


def enable_thinking(body: ResponsesRequest) -> dict[str, bool] | None:
    effort = body.reasoning.effort if body.reasoning is not None else None
    return None if effort is None else {"enable_thinking": effort != "none"}


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
        "model": body.model,  # a LoRA adapter's name picks it (server/state.py `adapter`)
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "stream": body.stream,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "logprobs": with_logprobs,
        "top_logprobs": body.top_logprobs if with_logprobs else None,
        "kv_transfer_params": body.kv_transfer_params,
        # a template that thinks reads `enable_thinking` (others ignore it): effort "none" turns
        # the thought off, any other on, none given leaves the template's default
        "chat_template_kwargs": enable_thinking(body),
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


def render_responses(
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
            raise as_input_error(e, sources, num_stored) from None
        if len(ids) <= room or body.truncation != "auto" or len(items) <= 1:
            return chat, RenderedChat(ids, tools)
        dropped = 1
        while dropped < len(items) - 1 and items[dropped]["type"] != "message":
            dropped += 1  # no orphaned call outputs
        items, num_stored = items[dropped:], num_stored - dropped


def as_input_error(e: APIError, sources: list[int | None], num_stored: int) -> APIError:
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
