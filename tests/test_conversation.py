"""The neutral conversation (server/flow/conversation.py) every generating route maps its body
into: one conversation sent as a chat request, an Anthropic Messages request and a Responses
request becomes the same turns and tools (so the one renderer makes one prompt of it), and what a
client got wrong is named by its own API's field as the error is raised. No model: bodies in,
conversations out."""

from __future__ import annotations

from typing import Any

import pytest

from server.errors import APIError
from server.flow.chat_plan import chat_conversation
from server.flow.chat_prompt import TemplateTraits, template_messages
from server.flow.constraints import grammar_for, tool_plan
from server.flow.conversation import Conversation
from server.flow.messages_plan import messages_conversation
from server.flow.responses_items import input_items
from server.flow.responses_plan import responses_conversation
from server.protocol.anthropic import MessagesRequest
from server.protocol.openai import ChatCompletionRequest
from server.protocol.responses import ResponsesRequest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
ARGS = '{"city": "Paris"}'


def deep(levels: int) -> dict[str, Any]:
    """A schema nested past the structured-output limits (schema_limits.MAX_DEPTH)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def chat(tools: list[dict] | None = None, **extra: Any) -> Conversation:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": ARGS}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "user", "content": "And Tokyo?"},
    ]
    tools = [{"type": "function", "function": t} for t in tools or [weather()]]
    body = {"messages": messages, "tools": tools, **extra}
    return chat_conversation(ChatCompletionRequest.model_validate(body))


def messages(tools: list[dict] | None = None, **extra: Any) -> Conversation:
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Paris"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "18 C"},
                {"type": "text", "text": "And Tokyo?"},
            ],
        },
    ]
    tools = [
        {"name": t["name"], "description": t.get("description"), "input_schema": t["parameters"]}
        for t in tools or [weather()]
    ]
    body = {"max_tokens": 8, "system": "Be brief.", "messages": turns, "tools": tools, **extra}
    return messages_conversation(MessagesRequest.model_validate(body))


def responses(tools: list[dict] | None = None, **extra: Any) -> Conversation:
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"role": "user", "content": "And Tokyo?"},
    ]
    tools = [{"type": "function", **t} for t in tools or [weather()]]
    body = ResponsesRequest.model_validate(
        {"instructions": "Be brief.", "input": items, "tools": tools, **extra}
    )
    assert body.input is not None and not isinstance(body.input, str)
    return responses_conversation(body, input_items(body.input), 0)


def weather(name: str = "weather", parameters: dict | None = None) -> dict[str, Any]:
    return {"name": name, "description": "Weather now", "parameters": parameters or SCHEMA}


@pytest.mark.parametrize("knows_tools", [True, False])
def test_one_conversation_from_three_apis_renders_the_same(knows_tools) -> None:
    traits = TemplateTraits(knows_tools=knows_tools, knows_developer=False)
    rendered = []
    for conversation in (chat(), messages(), responses()):
        tools = [t.template_entry() for t in conversation.tools]
        rendered.append((template_messages(conversation.turns, traits, conversation.tools), tools))
    assert rendered[0] == rendered[1] == rendered[2]
    assert [t.role for t in chat().turns] == ["system", "user", "assistant", "tool", "user"]


def raised(make: Any) -> APIError:
    with pytest.raises(APIError) as e:
        make()
    return e.value


def test_errors_name_each_apis_own_fields() -> None:
    # a schema past the limits, where each API puts a tool's schema
    forced = {
        "chat": {"tool_choice": "required"},
        "messages": {"tool_choice": {"type": "any"}},
        "responses": {"tool_choice": "required"},
    }
    want = {
        "chat": "tools.0.function.parameters",
        "messages": "tools.0.input_schema",
        "responses": "tools.0.parameters",
    }
    for name, route in (("chat", chat), ("messages", messages), ("responses", responses)):
        conversation = route([weather(parameters=deep(12))], **forced[name])
        e = raised(lambda c=conversation: grammar_for(c.rules, tool_plan(c)))
        assert e.param == want[name] and e.message.startswith(want[name]), e.message
        # two tools of one name: the second is named
        conversation = route([weather(), weather()])
        assert raised(lambda c=conversation: tool_plan(c)).param == "tools.1"
    # the answer's format, too large, where each API asks for it
    e = raised(
        lambda: chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": deep(12)},
            }
        )
    )
    assert e.param == "response_format"
    e = raised(
        lambda: messages(output_config={"format": {"type": "json_schema", "schema": deep(12)}})
    )
    assert e.param == "output_config.format" and e.message.startswith("output_config.format")
    e = raised(
        lambda: responses(text={"format": {"type": "json_schema", "name": "x", "schema": deep(12)}})
    )
    assert e.param == "text.format" and e.message.startswith("text.format")


def test_a_choice_and_a_budget_keep_their_apis_names() -> None:
    conversation = messages(tool_choice={"type": "tool", "name": "nope"})
    e = raised(lambda: tool_plan(conversation))
    assert e.param == "tool_choice" and e.message.startswith("tool_choice names 'nope'")
    thinking = {"type": "enabled", "budget_tokens": 64}
    budget = messages(thinking=thinking).thought_budget
    assert budget is not None and budget.param == "thinking.budget_tokens"
    budget = chat(thinking_budget=64).thought_budget
    assert budget is not None and budget.param == "thinking_budget"
    legacy = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "functions": [weather()],
            "function_call": {"name": "nope"},
        }
    )
    e = raised(lambda: tool_plan(chat_conversation(legacy)))
    assert e.param == "function_call"


def test_a_part_no_model_here_reads_is_named_where_it_was_sent() -> None:
    """An audio part is refused as the body becomes a conversation; an image part becomes the
    turn's image (a text model refuses it when the images are read: tests/test_vision_server.py
    and tests/test_tools_structured.py)."""
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, audio]}]}
    e = raised(lambda: chat_conversation(ChatCompletionRequest.model_validate(body)))
    assert e.param == "messages.0.content.1" and e.code == "unsupported_content"
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    (turn,) = chat_conversation(ChatCompletionRequest.model_validate(body)).turns
    images = [p.param for p in turn.parts if not isinstance(p, str)]
    assert turn.text == "hi" and images == ["messages.0.content.1"]
    body = ResponsesRequest.model_validate({"input": []})
    assert raised(lambda: responses_conversation(body, [], 0)).param == "input"
