"""A chat request's plan: its prompt rendered through the model's template, its tool plan and
grammar, and the parser that reads calls back from the text. Chat completions make it from
their body; the Responses API from its items mapped onto chat (server/routes/responses.py),
having rendered and truncated the prompt itself. Made once, immutable."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.async_engine import AsyncEngine
from engine.core.sampling_params import ThoughtBudget
from server.errors import APIError
from server.flow.chat_prompt import render_prompt
from server.flow.constraints import ToolPlan, grammar_for, tool_plan
from server.flow.plan import GenerationPlan
from server.flow.reasoning import (
    CLOSE,
    OPEN,
    ReasoningPlan,
    opened_by_prompt,
    split_reasoning,
    thinks,
)
from server.flow.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolParser,
    final_calls,
    parser_for_template,
    with_determined_name,
)
from server.protocol.openai import ChatCompletionRequest
from server.state import ServerState


def tool_parser(state: ServerState, engine: AsyncEngine) -> ToolParser:
    name = state.config.server.tool_call_parser
    if name != "auto":
        return PARSERS[name]
    return parser_for_template(engine.tokenizer.chat_template if engine.tokenizer else None)


@dataclass(frozen=True)
class RenderedChat:
    """A chat request's prompt and the tool plan it was rendered with."""

    prompt_ids: list[int]
    tools: ToolPlan | None


def render_chat(
    engine: AsyncEngine, body: ChatCompletionRequest, tools: ToolPlan | None
) -> list[int]:
    return render_prompt(
        engine.tokenizer,
        body.messages,
        body.add_generation_prompt,
        tools.tools if tools else None,
        **(body.chat_template_kwargs or {}),
    )


@dataclass(frozen=True)
class ChatPlan:
    """A chat request's generation plan and what formatting its output needs: the tool plan,
    and the parser that finds calls in the text (None when calls are not parsed)."""

    generation: GenerationPlan
    tools: ToolPlan | None
    calls_parser: ToolParser | None
    legacy: bool  # `functions` (not `tools`): calls come back as `function_call`
    reasoning: ReasoningPlan | None = None  # None: the model does not think


@dataclass(frozen=True)
class Answer:
    """A finished output read by its plan: the thought (None: the model did not think), the
    text outside calls, and the calls (at most one unless parallel). `began_call`: call markup
    was begun, so it is no part of the text, even when the cap cut it off before a name."""

    thought: str | None
    text: str
    calls: list[ToolCall]
    began_call: bool


def read_answer(plan: ChatPlan, output: str) -> Answer:
    """What every route makes of a finished choice's text (chat's message, Anthropic's content
    blocks): the thought apart, then the calls in what follows it."""
    thought, answer = None, output
    if plan.reasoning is not None:
        thought, answer = split_reasoning(output, plan.reasoning)
    if plan.calls_parser is None or plan.tools is None:
        return Answer(thought, answer, [], False)
    parsed = with_determined_name(plan.calls_parser.parse(answer), plan.tools.determined_name)
    if not parsed.calls:  # no call begun: the text as written
        return Answer(thought, answer, [], False)
    calls = final_calls(parsed)[: None if plan.tools.parallel else 1]
    return Answer(thought, parsed.content.strip(), calls, True)


def reasoning_plan(
    state: ServerState, engine: AsyncEngine, prompt_ids: list[int]
) -> ReasoningPlan | None:
    """Whether (and where) this request's output holds a thought: the template thinks and the
    server reads thoughts; generation starts inside one when the prompt opened it."""
    tok = engine.tokenizer
    if (
        state.config.server.reasoning_parser == "none"
        or tok is None
        or not thinks(tok.chat_template)
    ):
        return None
    tail = tok.decode(prompt_ids[-16:], skip_special_tokens=False)
    return ReasoningPlan(inside=opened_by_prompt(tail))


def chat_plan(
    state: ServerState,
    engine: AsyncEngine,
    body: ChatCompletionRequest,
    req_id: str,
    session: str | None,
    rendered: RenderedChat | None = None,
    param_names: dict[str, str] | None = None,
) -> ChatPlan:
    """The plan of a chat request. `rendered`: the prompt and tool plan, when the caller made
    them already; `param_names`: shared code's parameter names as the caller's API spells
    them."""
    cfg = state.config.server
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(
                400, "logprobs must be true when top_logprobs is set", param="top_logprobs"
            )
        if body.top_logprobs > cfg.max_top_logprobs:
            raise APIError(
                400, f"top_logprobs must be at most {cfg.max_top_logprobs}", param="top_logprobs"
            )
    parser = tool_parser(state, engine)
    tools = rendered.tools if rendered is not None else tool_plan(body)
    grammar = grammar_for(body, tools, parser.name)
    if rendered is None:
        rendered = RenderedChat(render_chat(engine, body, tools), tools)
    generation = GenerationPlan(
        req_id=req_id,
        body=body,
        prompts=[rendered.prompt_ids],
        max_tokens=body.max_completion_tokens or body.max_tokens or cfg.default_max_tokens or None,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        grammar=grammar,
        session=session,
        kv_transfer_params=body.kv_transfer_params,
        param_names=param_names or {},
        streamed=bool(body.stream),
    )
    calls_parser = parser if tools is not None and tools.parses else None
    # a grammar shapes the output from its first token: no room for a thought
    reasoning = None if generation.grammar else reasoning_plan(state, engine, rendered.prompt_ids)
    if body.thinking_budget is not None and reasoning is not None:
        budget = thought_budget(engine, body.thinking_budget, reasoning)
        generation = replace(generation, thought_budget=budget)
    return ChatPlan(generation, tools, calls_parser, body.functions is not None, reasoning)


def thought_budget(engine: AsyncEngine, tokens: int, reasoning: ReasoningPlan) -> ThoughtBudget:
    """The budget in this tokenizer's ids; its end is forced as one token, so a tokenizer that
    spells `</think>` in several cannot bound a thought (a 400 naming the field)."""
    assert engine.tokenizer is not None
    ids = {tag: engine.tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)}
    if len(ids[CLOSE]) != 1 or (not reasoning.inside and len(ids[OPEN]) != 1):
        why = "this model's tokenizer spells <think> or </think> in several tokens"
        raise APIError(400, f"thinking_budget: {why}; its thought cannot be bounded",
                       param="thinking_budget")  # fmt: skip
    open_id = None if reasoning.inside else ids[OPEN][0]
    return ThoughtBudget(tokens, ids[CLOSE][0], open_id)
