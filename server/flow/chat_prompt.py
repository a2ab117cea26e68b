"""A conversation (server/flow/conversation.py) and its tools to the prompt the model's template
expects: the one renderer every generating route's prompt goes through.

A template that knows tools (it reads a `tools` variable) receives them, and history with
assistant `tool_calls` (arguments as objects, as `transformers`' `apply_chat_template` wants
them) and tool results, as they are. A template that knows no tools gets our documented
fallback, in the Hermes format the `hermes` parser reads: the tool list and calling convention in
the system prompt, earlier calls as `<tool_call>` blocks in the assistant's text, and tool results
as `<tool_response>` blocks in a user turn. `developer` becomes `system` where the template has no
such role.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from models.chat_template import TemplateError
from models.tokenizer import Tokenizer
from server.errors import APIError
from server.flow.conversation import Conversation, Tool, Turn

FALLBACK_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class TemplateTraits:
    knows_tools: bool
    knows_developer: bool

    @staticmethod
    def of(template: str | None) -> TemplateTraits:
        source = template or ""
        return TemplateTraits("tools" in source, "developer" in source)


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as the template wants them: the JSON value when they are JSON, else
    the text as sent (OpenAI takes any string: a call cut off at the token cap comes back
    unfinished, and the next turn must still render it)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _tool_call_block(name: str, arguments: Any) -> str:
    """A call in the fallback (Hermes) format, as the model wrote it: unfinished arguments
    text is rendered back verbatim."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    call = '{"name": ' + json.dumps(name) + ', "arguments": ' + args + "}"
    return "<tool_call>\n" + call + "\n</tool_call>"


def template_messages(
    turns: list[Turn], traits: TemplateTraits, tools: Sequence[Tool] | None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    tool_turns: set[int] = set()  # indices in `out` of user turns holding tool results
    for turn in turns:
        role = turn.role
        if role == "developer" and not traits.knows_developer:
            role = "system"
        text = turn.text or ""
        entry: dict[str, Any] = {"role": role, "content": text}
        if turn.parts:  # a turn with images: its parts in order, as templates read them
            entry["content"] = [
                {"type": "image"} if not isinstance(p, str) else {"type": "text", "text": p}
                for p in turn.parts
            ]
        if turn.name:
            entry["name"] = turn.name
        if turn.thought is not None and role == "assistant":
            entry["reasoning_content"] = turn.thought
        if traits.knows_tools:
            if turn.calls:
                entry["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _arguments_object(c.arguments)},
                    }
                    for c in turn.calls
                ]
                if turn.text is None:
                    entry["content"] = None
            if role == "tool" and turn.call_id:
                entry["tool_call_id"] = turn.call_id
        else:
            if turn.calls:
                blocks = [
                    _tool_call_block(c.name, _arguments_object(c.arguments)) for c in turn.calls
                ]
                entry["content"] = "\n".join([t for t in [text] if t] + blocks)
            if role == "tool":
                entry = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
                tool_turns.add(len(out))
        # results of parallel calls (and a user turn after them) in one user turn, as Hermes
        # templates render them: templates that insist on alternating roles (Gemma's) accept it
        merge = out and out[-1]["role"] == entry["role"] == "user"
        merge = merge and isinstance(entry["content"], str)  # a turn with images stays whole
        if merge and (len(out) - 1 in tool_turns or len(out) in tool_turns):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + entry["content"]}
            tool_turns.add(len(out) - 1)
            tool_turns.discard(len(out))
            continue
        out.append(entry)
    if tools and not traits.knows_tools:
        listing = "\n".join(json.dumps(t.template_entry()) for t in tools)
        prompt = FALLBACK_TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_prompt(
    tokenizer: Tokenizer | None, conversation: Conversation, tools: Sequence[Tool] | None = None
) -> list[int]:
    """Token ids of the rendered conversation, offered `tools` (those of its tool plan). A
    template's refusal is a 400 naming the field that holds the turns."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer; use /v1/completions with token ids")
    return tokenizer.encode(render_text(tokenizer, conversation, tools), add_special_tokens=False)


def render_text(
    tokenizer: Tokenizer | None, conversation: Conversation, tools: Sequence[Tool] | None = None
) -> str:
    """The rendered conversation as text (`render_prompt` before tokenizing)."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer; use /v1/completions with token ids")
    traits = TemplateTraits.of(tokenizer.chat_template)
    rendered = template_messages(conversation.turns, traits, tools)
    template_kwargs = dict(conversation.template_kwargs)
    if tools and traits.knows_tools:
        template_kwargs["tools"] = [t.template_entry() for t in tools]
    param = conversation.param
    try:
        text = tokenizer.apply_chat_template(
            rendered, add_generation_prompt=conversation.add_generation_prompt, **template_kwargs
        )
    except (TemplateError, ValueError) as e:
        raise APIError(400, str(e), param=param) from None
    except TypeError as e:  # a template concatenating a null content
        raise APIError(400, f"chat template failed: {e}", param=param) from None
    return text
