"""An Anthropic Messages request as a neutral conversation (server/flow/conversation.py): its
system prompt, messages and content blocks become turns (tool_use blocks the assistant's calls,
tool_result blocks tool results), its tools, tool_choice, output format and thinking settings the
conversation's, each named as the Messages API names them, so the template, the grammar that
forces calls and the sampler are the ones every route uses. Image blocks are a user turn's
images (a 400 naming the block for a text model); documents and server tools are a 400 naming
the block. A cache breakpoint keeps the
prompt up to it warm past the request."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Literal

from starlette.requests import Request

from engine.async_engine import AsyncEngine
from engine.core.sampling_params import KeepPrefix
from server.errors import APIError
from server.flow.constraints import schema_spec
from server.flow.conversation import (
    Budget,
    Call,
    Conversation,
    ImageRef,
    OutputRule,
    Tool,
    ToolChoice,
    Turn,
)
from server.flow.conversation_plan import ConversationPlan, plan_conversation, render
from server.flow.plan import GenerationPlan, app_name, sampling_fields, session_id
from server.protocol.anthropic import TEXT_BLOCKS, AnthropicContentBlock, MessagesRequest
from server.state import ServerState

# the engine's sampling parameters as the Messages API spells them, for the errors it raises
PARAM_NAMES = {"stop": "stop_sequences", "user": "metadata.user_id"}
_TOOL_CHOICES: dict[str, Literal["auto", "required", "none"]] = {
    "auto": "auto",
    "any": "required",
    "none": "none",
}


def _refuse(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def _text_of(blocks: str | list[AnthropicContentBlock] | None, where: str) -> str:
    """The text of a string or of text blocks (a tool result's content, a system prompt)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise _refuse(f"{where}.{j}.type", f"{block.type!r} blocks cannot go here; text can")
        parts.append(block.text or "")
    return "".join(parts)


def breakpoint_of(body: MessagesRequest, turns: list[Turn]) -> tuple[int | None, float] | None:
    """Where the last cache breakpoint is, as the turn it ends (None: the whole prompt, for a
    top-level mark) and its TTL in seconds; None when nothing is marked."""
    marks: list[tuple[int | None, str | None]] = []
    if body.cache_control is not None:
        marks.append((None, body.cache_control.ttl))
    system = body.system if isinstance(body.system, list) else []
    for block in [*system, *(body.tools or [])]:
        if block.cache_control is not None:  # the system prompt (tools render into it)
            marks.append((0, block.cache_control.ttl))
    for i, m in enumerate(body.messages):
        for block in m.content if isinstance(m.content, list) else []:
            if block.cache_control is not None:
                last = max(k for k, t in enumerate(turns) if t.source == f"messages.{i}")
                marks.append((last, block.cache_control.ttl))
    if not marks:
        return None
    end = None if any(k is None for k, _ in marks) else max(k for k, _ in marks if k is not None)
    ttl = 3600.0 if any(t == "1h" for _, t in marks) else 300.0
    return end, ttl


def messages_turns(body: MessagesRequest) -> list[Turn]:
    """The system prompt and the messages as turns, each with the field it came from."""
    turns: list[Turn] = []
    system = _text_of(body.system, "system")
    if system:
        turns.append(Turn("system", system, source="system"))
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if isinstance(m.content, str):
            turns.append(Turn(m.role, m.content, source=where))
        elif m.role == "system":
            turns.append(Turn("system", _text_of(m.content, f"{where}.content"), source=where))
        elif m.role == "user":
            turns += _user_turn(m.content, where)
        else:
            turns.append(_assistant_turn(m.content, where))
    return turns


def _check_block(block: AnthropicContentBlock, where: str) -> None:
    if block.type not in TEXT_BLOCKS:
        raise _refuse(
            f"{where}.type",
            f"{block.type!r} blocks are not supported here; send "
            "text, image, tool_use or tool_result",
        )


def _user_turn(blocks: list[AnthropicContentBlock], where: str) -> list[Turn]:
    """Tool results become tool turns (in order), the rest of the text one user turn."""
    out: list[Turn] = []
    text: list[str] = []
    parts: list[str | ImageRef] = []  # the text and images in order
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        _check_block(block, at)
        if block.type == "image":
            assert block.source is not None
            parts.append(ImageRef(block.source.as_url(), at))
            continue
        if block.type == "tool_result":
            result = _text_of(block.content, f"{at}.content")
            if block.is_error:
                result = f"Error: {result}"
            out.append(Turn("tool", result, call_id=block.tool_use_id, source=where))
        elif block.type == "text":
            text.append(block.text or "")
            parts.append(block.text or "")
        else:
            raise _refuse(f"{at}.type", f"a user turn cannot hold {block.type!r} blocks")
    images = len(parts) > len(text)
    if text or images or not out:
        turn = Turn("user", "".join(text), source=where)
        if images:
            turn.parts = tuple(parts)
        out.append(turn)
    return out


def _assistant_turn(blocks: list[AnthropicContentBlock], where: str) -> Turn:
    """Text and tool_use blocks as one assistant turn; replayed thinking is history this
    model's template has no place for (it does not reason), so it is left out of the prompt."""
    text, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        _check_block(block, at)
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "tool_use":
            assert block.id is not None and block.name is not None  # the block's own check
            calls.append(Call(block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
        elif block.type == "tool_result":
            raise _refuse(f"{at}.type", "tool_result blocks belong in a user turn")
    content = "".join(text) or None
    return Turn("assistant", content if calls or content else "", calls, source=where)


def messages_tools(body: MessagesRequest) -> tuple[Tool, ...]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise _refuse(
                f"tools.{i}.type",
                f"server tool {tool.type!r} is not available here; "
                "client tools (name, input_schema) are",
            )
        if tool.input_schema is None:
            raise APIError(
                400, f"tools.{i}.input_schema: required", param=f"tools.{i}.input_schema"
            )
        tools.append(
            Tool(
                tool.name,
                tool.description,
                tool.input_schema,
                None,
                f"tools.{i}",
                f"tools.{i}.input_schema",
            )
        )
    return tuple(tools)


def messages_conversation(body: MessagesRequest) -> Conversation:
    """The conversation the Messages request asks to continue."""
    turns = messages_turns(body)
    tools = messages_tools(body)
    choice = body.tool_choice
    if choice is not None and choice.type != "none" and not tools:
        raise APIError(400, "tool_choice: needs tools to choose from", param="tool_choice")
    tool_choice = None
    if choice is not None and tools and choice.type == "tool":
        tool_choice = ToolChoice("named", choice.name)
    elif choice is not None and tools:
        tool_choice = ToolChoice(_TOOL_CHOICES[choice.type])
    fmt = body.output_config.format if body.output_config else None
    rules: tuple[OutputRule, ...] = ()
    if fmt is not None:
        param = "output_config.format"
        rules = (OutputRule(param, schema_spec(fmt.schema_, param), answer_format=True),)
    thinking = body.thinking
    budget = thinking.budget_tokens if thinking is not None else None
    return Conversation(
        turns=turns,
        param="messages",
        tools=tools,
        tool_choice=tool_choice,
        parallel_calls=not (choice is not None and choice.disable_parallel_tool_use),
        rules=rules,
        # Anthropic's default is not to think; `thinking` turns it on (for a template that
        # thinks: others ignore the variable)
        template_kwargs={"enable_thinking": thinking is not None and thinking.type != "disabled"},
        thought_budget=Budget(budget, "thinking.budget_tokens") if budget is not None else None,
    )


async def messages_plan(
    state: ServerState,
    engine: AsyncEngine,
    request: Request,
    body: MessagesRequest,
    conversation: Conversation,
    msg_id: str,
) -> tuple[ConversationPlan, bool]:
    """The request's plan, with the prefix up to its last cache breakpoint kept warm; and
    whether it marks breakpoints (its usage then counts the cache writes)."""
    user = body.metadata.user_id if body.metadata else None
    session = session_id(request, user)
    sampling = sampling_fields(
        {
            "model": body.model,
            "stream": body.stream,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences or None,
            "user": user,
        },
        PARAM_NAMES,
    )
    generation = GenerationPlan(
        req_id=msg_id,
        body=sampling,
        prompts=[],
        max_tokens=body.max_tokens,
        logprobs=None,
        session=session,
        streamed=body.stream,
        param_names=PARAM_NAMES,
    )
    plan = await plan_conversation(state, engine, conversation, generation)
    mark = breakpoint_of(body, conversation.turns)
    if mark is not None and engine.info.prefix_caching:
        keep = kept_prefix(engine, plan, conversation, mark, app_name(request, sampling))
        plan = replace(plan, generation=replace(plan.generation, keep_prefix=keep))
    return plan, mark is not None


def kept_prefix(
    engine: AsyncEngine,
    plan: ConversationPlan,
    conversation: Conversation,
    mark: tuple[int | None, float],
    app: str,
) -> KeepPrefix:
    """The prompt up to the breakpoint's turn, in tokens (the conversation rendered up to it:
    templates render a conversation's turns as a prefix of the whole), kept `ttl` s."""
    end, ttl = mark
    num_tokens = len(plan.generation.prompts[0])
    if end is not None:
        upto = replace(
            conversation, turns=conversation.turns[: end + 1], add_generation_prompt=False
        )
        num_tokens = min(num_tokens, len(render(engine, upto, plan.tools, plan.images)[0]))
    return KeepPrefix(num_tokens, ttl, app)
