"""A Responses API request as a neutral conversation (server/flow/conversation.py): what it asks
that this server refuses (400, naming the field), the functions it offers the model (namespaces
flattened as `namespace.name`, hosted tools skipped), and its items as turns (with
`truncation: auto`, cut from the oldest item until the prompt fits); the template, the
constraints and the sampler are every route's. Each value keeps the field the client sent it
in, so errors name `input`, `text.format`, `tools.i...` as they are raised."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from engine.async_engine import AsyncEngine
from engine.grammar.structured_output import GrammarSpec
from server.errors import APIError
from server.flow.constraints import schema_spec
from server.flow.conversation import (
    Call,
    Conversation,
    ImageRef,
    OutputRule,
    Tool,
    ToolChoice,
    Turn,
)
from server.flow.conversation_plan import ConversationPlan, plan_conversation
from server.flow.plan import GenerationPlan, logprobs_of, sampling_fields
from server.flow.responses_items import model_function_name, thought_of
from server.protocol.responses import (
    HOSTED_TOOLS,
    INCLUDE_EMPTY,
    INCLUDE_LOGPROBS,
    REASONING_EFFORTS,
    REASONING_SUMMARIES,
    FunctionTool,
    ResponsesRequest,
)
from server.state import ServerState

# the engine's sampling parameters as the Responses API spells them, for the errors it raises
PARAM_NAMES = {"max_tokens": "max_output_tokens"}


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


def namespaces(body: ResponsesRequest) -> frozenset[str]:
    return frozenset(t.name for t in body.tools or [] if t.type == "namespace" and t.name)


def enable_thinking(body: ResponsesRequest) -> dict[str, bool]:
    """A template that thinks reads `enable_thinking` (others ignore it): effort "none" turns
    the thought off, any other on, none given leaves the template's default."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    return {} if effort is None else {"enable_thinking": effort != "none"}


def responses_turns(
    items: list[dict[str, Any]], instructions: str | None, num_stored: int
) -> list[Turn]:
    """The conversation's turns: function calls join the assistant turn they follow, their
    outputs are tool results, a reasoning item is the thought of the assistant turn after it.
    Each turn's source is what the client sent: `instructions`, `input.k`, or
    `previous_response_id` (`items`: the `num_stored` items of the previous response, then the
    client's `input`)."""
    turns: list[Turn] = []
    if instructions:
        turns.append(Turn("system", instructions, source="instructions"))
    thought: str | None = None
    for k, item in enumerate(items):
        where = "previous_response_id" if k < num_stored else f"input.{k - num_stored}"
        if item["type"] == "reasoning":
            thought = thought_of(item)
            continue
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"] if "text" in p)
            turn = Turn(item["role"], text, source=where)
            if any(p["type"] == "input_image" for p in item["content"]):
                turn.parts = tuple(
                    p["text"] if "text" in p else ImageRef(p["image_url"], f"{where}.content.{j}")
                    for j, p in enumerate(item["content"])
                )
            turns.append(turn)
        elif item["type"] == "function_call":
            name = model_function_name(item.get("namespace"), item["name"])
            call = Call(item["call_id"], name, item["arguments"])
            if turns and turns[-1].role == "assistant":
                turns[-1].calls.append(call)
            else:
                turns.append(Turn("assistant", None, [call], source=where))
        else:  # function_call_output
            turns.append(Turn("tool", item["output"], call_id=item["call_id"], source=where))
        if thought is not None and turns and turns[-1].role == "assistant":
            turns[-1].thought, thought = thought, None
    return turns


def output_rules(body: ResponsesRequest) -> tuple[OutputRule, ...]:
    """`text.format` as the answer's format (json_schema's schema checked by
    refuse_unsupported)."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return ()
    if fmt.type == "json_object":
        return (OutputRule("text.format", GrammarSpec("json_object", ""), answer_format=True),)
    assert fmt.json_schema is not None
    spec = schema_spec(fmt.json_schema, "text.format")
    return (OutputRule("text.format", spec, answer_format=True),)


def responses_conversation(
    body: ResponsesRequest, items: list[dict[str, Any]], num_stored: int
) -> Conversation:
    turns = responses_turns(items, body.instructions, num_stored)
    if not turns:
        raise APIError(400, "input: no instructions and no items to answer", param="input")
    tools = tuple(
        Tool(
            model_function_name(namespace, tool.name or ""),
            tool.description,
            tool.parameters,
            tool.strict,
            where,
            f"{where}.parameters",
        )
        for where, namespace, tool in offered_functions(body)
    )
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        tool_choice = None if choice is None else ToolChoice(choice)
    else:
        tool_choice = ToolChoice("named", choice.name)
    return Conversation(
        turns=turns,
        param="input",
        tools=tools,
        tool_choice=tool_choice,
        parallel_calls=body.parallel_tool_calls is not False,
        max_calls=body.max_tool_calls,
        rules=output_rules(body),
        template_kwargs=enable_thinking(body),
    )


def truncation(
    body: ResponsesRequest, room: int, items: list[dict[str, Any]], num_stored: int
) -> Callable[[int], Conversation | None]:
    """With `truncation: auto`, a prompt that leaves no room for the output is rendered again
    without its oldest items (never an orphaned call output, never the last item). `items`:
    the `num_stored` items of the previous response, then the client's `input`."""

    def shorter(num_tokens: int) -> Conversation | None:
        nonlocal items, num_stored
        if num_tokens <= room or len(items) <= 1:
            return None
        dropped = 1
        while dropped < len(items) - 1 and items[dropped]["type"] != "message":
            dropped += 1  # no orphaned call outputs
        items, num_stored = items[dropped:], num_stored - dropped
        return responses_conversation(body, items, num_stored)

    return shorter


async def responses_plan(
    state: ServerState,
    engine: AsyncEngine,
    body: ResponsesRequest,
    items: list[dict[str, Any]],
    num_stored: int,
    resp_id: str,
    session: str,
) -> ConversationPlan:
    """The request's plan: its conversation (`items`: the `num_stored` items of the previous
    response, then the client's input), truncated to fit when asked, generated as the body's
    sampling fields, output cap and logprobs say."""
    with_logprobs = INCLUDE_LOGPROBS in (body.include or []) or bool(body.top_logprobs)
    top = body.top_logprobs if with_logprobs else None
    logprobs = logprobs_of(state, with_logprobs, top)
    sampling = {
        "model": body.model,
        "stream": body.stream,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
    }
    generation = GenerationPlan(
        req_id=resp_id,
        body=sampling_fields(sampling, PARAM_NAMES),
        prompts=[],
        max_tokens=body.max_output_tokens or state.config.server.default_max_tokens or None,
        logprobs=logprobs,
        session=session,
        kv_transfer_params=body.kv_transfer_params,
        streamed=bool(body.stream),
        param_names=PARAM_NAMES,
    )
    conversation = responses_conversation(body, items, num_stored)
    shorter = None
    if body.truncation == "auto":
        room = engine.info.max_model_len - (body.max_output_tokens or 1)
        shorter = truncation(body, room, items, num_stored)
    return await plan_conversation(state, engine, conversation, generation, shorter)
