"""An Anthropic Messages request as a chat plan: its system prompt, messages and content blocks
become chat messages (tool_use blocks the assistant's tool calls, tool_result blocks tool
messages), its tools, tool_choice and sampling fields chat's own, so the template, the grammar
that forces calls and the sampler are the ones every route uses. What a text model cannot take
(images, documents, server tools) is a 400 naming the block; an error the chat path raises about
`messages.i` is named by the Messages request's own index."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from server.errors import APIError
from server.protocol.anthropic import TEXT_BLOCKS, AnthropicContentBlock, MessagesRequest
from server.protocol.openai import ChatCompletionRequest

# chat's parameter names as the Messages API spells them, for errors raised by shared code
PARAM_NAMES = {
    "max_completion_tokens": "max_tokens",
    "thinking_budget": "thinking.budget_tokens",
    "response_format": "output_config.format",
    "stop": "stop_sequences",
    "tool_choice": "tool_choice",
    "user": "metadata.user_id",
}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


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


def breakpoint_of(body: MessagesRequest, sources: list[str]) -> tuple[int | None, float] | None:
    """Where the last cache breakpoint is, as the chat message it ends (None: the whole
    prompt, for a top-level mark) and its TTL in seconds; None when nothing is marked."""
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
                last = max(k for k, s in enumerate(sources) if s == f"messages.{i}")
                marks.append((last, block.cache_control.ttl))
    if not marks:
        return None
    end = None if any(k is None for k, _ in marks) else max(k for k, _ in marks if k is not None)
    ttl = 3600.0 if any(t == "1h" for _, t in marks) else 300.0
    return end, ttl


def chat_messages(body: MessagesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation as chat-completions messages, and for each the Messages parameter it
    came from (`system` or `messages.i`)."""
    out: list[dict[str, Any]] = []
    sources: list[str] = []
    system = _text_of(body.system, "system")
    if system:
        out.append({"role": "system", "content": system})
        sources.append("system")
    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        before = len(out)
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "system":
            out.append({"role": "system", "content": _text_of(m.content, f"{where}.content")})
        elif m.role == "user":
            out += _user_turn(m.content, where)
        else:
            out.append(_assistant_turn(m.content, where))
        sources += [where] * (len(out) - before)
    return out, sources


def _check_block(block: AnthropicContentBlock, where: str) -> None:
    if block.type not in TEXT_BLOCKS:
        raise _refuse(f"{where}.type", f"{block.type!r} blocks are not supported by this "
                      "text model; send text, tool_use or tool_result")  # fmt: skip


def _user_turn(blocks: list[AnthropicContentBlock], where: str) -> list[dict[str, Any]]:
    """Tool results become tool messages (in order), the rest of the text one user message."""
    out: list[dict[str, Any]] = []
    text = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        _check_block(block, at)
        if block.type == "tool_result":
            result = _text_of(block.content, f"{at}.content")
            if block.is_error:
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
        elif block.type == "text":
            text.append(block.text or "")
        else:
            raise _refuse(f"{at}.type", f"a user turn cannot hold {block.type!r} blocks")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_turn(blocks: list[AnthropicContentBlock], where: str) -> dict[str, Any]:
    """Text and tool_use blocks as one assistant message; replayed thinking is history this
    model's template has no place for (it does not reason), so it is left out of the prompt."""
    text, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        _check_block(block, at)
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "tool_use":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": arguments}})  # fmt: skip
        elif block.type == "tool_result":
            raise _refuse(f"{at}.type", "tool_result blocks belong in a user turn")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def chat_request(body: MessagesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request the Messages request is served as, and where each message came from."""
    messages, sources = chat_messages(body)
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            raise _refuse(f"tools.{i}.type", f"server tool {tool.type!r} is not available here; "
                          "client tools (name, input_schema) are")  # fmt: skip
        if tool.input_schema is None:
            raise APIError(
                400, f"tools.{i}.input_schema: required", param=f"tools.{i}.input_schema"
            )
    choice = body.tool_choice
    tool_choice: Any = None
    if choice is not None:
        tool_choice = _TOOL_CHOICES.get(choice.type) or {
            "type": "function", "function": {"name": choice.name},
        }  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description,
                                          "parameters": t.input_schema}}
        for t in body.tools or []
    ]  # fmt: skip
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    fmt = body.output_config.format if body.output_config else None
    response_format = None
    if fmt is not None:
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "output", "schema": fmt.schema_}}  # fmt: skip
    data: dict[str, Any] = {
        "model": body.model,  # a LoRA adapter's name picks it (server/state.py `adapter`)
        "messages": messages,
        "max_completion_tokens": body.max_tokens,
        "stream": body.stream,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences or None,
        "user": body.metadata.user_id if body.metadata else None,
        "tools": tools or None,
        "tool_choice": tool_choice if tools else None,
        "parallel_tool_calls": parallel if tools else None,
        "response_format": response_format,
        # Anthropic's default is not to think; `thinking` turns it on (for a template that
        # thinks: others ignore the variable)
        "chat_template_kwargs": {
            "enable_thinking": body.thinking is not None and body.thinking.type != "disabled"
        },
        "thinking_budget": body.thinking.budget_tokens if body.thinking is not None else None,
    }
    if choice is not None and choice.type != "none" and not tools:
        raise APIError(400, "tool_choice: needs tools to choose from", param="tool_choice")
    try:
        return ChatCompletionRequest.model_validate(data), sources
    except ValidationError as e:
        raise APIError(400, f"messages: {e.errors()[0]['msg']}", param="messages") from None


def as_messages_error(e: APIError, sources: list[str]) -> APIError:
    """An error the chat path raised about `messages.k...`, named by the Messages request."""
    match = re.match(r"messages\.(\d+)", e.param or "")
    if match is None or int(match.group(1)) >= len(sources):
        return e
    param = sources[int(match.group(1))] + (e.param or "")[match.end() :]
    e.message = e.message.replace(match.group(0), sources[int(match.group(1))], 1)
    e.param = param
    return e
