"""A chat completions body as a neutral conversation (server/flow/conversation.py): its messages
as turns (legacy `function` messages as tool results), its tools (or legacy `functions`), the
choice among them, its output constraints and template variables, each named as chat names
them; and its generation (sampling, limits, logprobs). The plan is then every route's
(`conversation_plan.py`)."""

from __future__ import annotations

from starlette.requests import Request

from engine.async_engine import AsyncEngine
from server.errors import APIError
from server.flow.constraints import requested
from server.flow.conversation import (
    Budget,
    Call,
    Conversation,
    ImageRef,
    Tool,
    ToolChoice,
    Turn,
)
from server.flow.conversation_plan import ConversationPlan, plan_conversation
from server.flow.plan import GenerationPlan, logprobs_of, session_id
from server.protocol.openai import ChatCompletionRequest, ChatMessage, ContentPart
from server.protocol.structured import ChatTool, FunctionDef, NamedToolChoice
from server.state import ServerState


def chat_turns(messages: list[ChatMessage]) -> list[Turn]:
    """Chat messages as turns, with their images; a part no model here reads is a 400 naming
    it."""
    turns = []
    for i, m in enumerate(messages):
        calls = [Call(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        if m.function_call is not None:  # a legacy assistant turn
            calls.append(Call("call_0", m.function_call.name, m.function_call.arguments))
        role = "tool" if m.role == "function" else m.role  # a legacy function's result
        parts = _parts(m.content, f"messages.{i}.content")
        text = m.content if parts is None else "".join(p for p in parts if isinstance(p, str))
        turn = Turn(role, text, calls, m.tool_call_id, m.name, m.reasoning_content, f"messages.{i}")
        if parts is not None and len(parts) != sum(isinstance(p, str) for p in parts):
            turn.parts = tuple(parts)
        turns.append(turn)
    return turns


def _parts(content: str | list[ContentPart] | None, where: str) -> list[str | ImageRef] | None:
    """A content list's text and images in order (None: the content is a string or absent)."""
    if content is None or isinstance(content, str):
        return None
    parts: list[str | ImageRef] = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        if part.type == "text" and part.text is not None:
            parts.append(part.text)
        elif part.type == "image_url" and part.image_url is not None:
            parts.append(ImageRef(part.image_url.url, at))
        else:
            why = f"a {part.type!r} part cannot be read (send text or image_url parts)"
            if part.type == "image_url":
                why = "an image_url part needs image_url.url"
            raise APIError(400, f"{at}: {why}", param=at, code="unsupported_content")
    return parts


def chat_tools(
    tools: list[ChatTool] | None, functions: list[FunctionDef] | None
) -> tuple[Tool, ...]:
    """`tools`, or the legacy `functions` in their place (not both)."""
    if functions is not None:
        if tools is not None:
            raise APIError(400, "send tools or functions, not both", param="functions")
        return tuple(
            _tool(f, f"functions.{i}", f"functions.{i}.parameters") for i, f in enumerate(functions)
        )
    return tuple(
        _tool(t.function, f"tools.{i}", f"tools.{i}.function.parameters")
        for i, t in enumerate(tools or [])
    )


def _tool(f: FunctionDef, param: str, schema_param: str) -> Tool:
    return Tool(f.name, f.description, f.parameters, f.strict, param, schema_param)


def chat_tool_choice(body: ChatCompletionRequest) -> ToolChoice | None:
    """`tool_choice`, or the legacy `function_call` in its place (not both)."""
    choice, param = body.tool_choice, "tool_choice"
    if body.function_call is not None:
        if choice is not None:
            raise APIError(
                400, "send tool_choice or function_call, not both", param="function_call"
            )
        choice, param = body.function_call, "function_call"
    if choice is None:
        return None
    if isinstance(choice, str):
        return ToolChoice(choice, None, param)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
    return ToolChoice("named", name, param)


def chat_conversation(body: ChatCompletionRequest) -> Conversation:
    legacy = body.functions is not None  # a legacy function_call answer is one call
    budget = body.thinking_budget
    return Conversation(
        turns=chat_turns(body.messages),
        param="messages",
        tools=chat_tools(body.tools, body.functions),
        tool_choice=chat_tool_choice(body),
        parallel_calls=body.parallel_tool_calls is not False,
        max_calls=1 if legacy else None,
        rules=tuple(requested(body)),
        template_kwargs=body.chat_template_kwargs or {},
        thought_budget=Budget(budget, "thinking_budget") if budget is not None else None,
        add_generation_prompt=body.add_generation_prompt is not False,
    )


async def chat_plan(
    state: ServerState,
    engine: AsyncEngine,
    request: Request,
    body: ChatCompletionRequest,
    req_id: str,
) -> ConversationPlan:
    cfg = state.config.server
    session = session_id(request, body.user)
    logprobs = logprobs_of(state, bool(body.logprobs), body.top_logprobs)
    generation = GenerationPlan(
        req_id=req_id,
        body=body,
        prompts=[],
        max_tokens=body.max_completion_tokens or body.max_tokens or cfg.default_max_tokens or None,
        logprobs=logprobs,
        session=session,
        kv_transfer_params=body.kv_transfer_params,
        streamed=bool(body.stream),
    )
    return await plan_conversation(state, engine, chat_conversation(body), generation)
