"""A conversation's plan, the same for every generating route: its tool plan and the one grammar
its output follows, its prompt rendered through the model's template, whether (and where) the
output holds a thought and its budget, and how the answer stream reads the output. A route maps
its body into a `Conversation` and describes the generation (sampling, limits, session); this
module does the rest. Made once, immutable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.async_engine import AsyncEngine
from engine.core.images import PromptImage
from engine.core.sampling_params import ThoughtBudget
from server.errors import APIError
from server.flow.answer import AnswerPlan
from server.flow.chat_prompt import render_prompt, render_text
from server.flow.constraints import ToolPlan, grammar_for, tool_plan
from server.flow.conversation import Budget, Conversation
from server.flow.images import ImageSet, images_of, load_images, place_images
from server.flow.plan import GenerationPlan
from server.flow.reasoning import ReasoningPlan, opened_by_prompt, thought_tags
from server.flow.tool_parsers import PARSERS, ToolParser, parser_for_template
from server.state import ServerState


def tool_parser(state: ServerState, engine: AsyncEngine) -> ToolParser:
    name = state.config.server.tool_call_parser
    if name != "auto":
        return PARSERS[name]
    return parser_for_template(engine.tokenizer.chat_template if engine.tokenizer else None)


def render(
    engine: AsyncEngine,
    conversation: Conversation,
    tools: ToolPlan | None,
    images: ImageSet | None = None,
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt's token ids and its images at their soft tokens (`images`: those of the
    conversation `conversation` was cut from, loaded by `load_images`)."""
    offered = tools.tools if tools else None
    refs = images_of(conversation) if images else []
    if not refs:
        return render_prompt(engine.tokenizer, conversation, offered), ()
    assert images is not None and engine.vision is not None and engine.tokenizer is not None
    text = render_text(engine.tokenizer, conversation, offered)
    loaded = [images[ref] for ref in refs]
    return place_images(engine.tokenizer, engine.vision, text, loaded, conversation.param)


@dataclass(frozen=True)
class ConversationPlan:
    """A conversation's generation plan, its tool plan, and how its answer is read."""

    generation: GenerationPlan
    tools: ToolPlan | None
    answer: AnswerPlan
    images: ImageSet = field(default_factory=dict)  # the conversation's, as read


async def plan_conversation(
    state: ServerState,
    engine: AsyncEngine,
    conversation: Conversation,
    generation: GenerationPlan,
    shorter: Callable[[int], Conversation | None] | None = None,
) -> ConversationPlan:
    """The plan of `conversation`, generated as `generation` describes (its prompts and grammar
    are filled in here). `shorter`: given the rendered prompt's length in tokens, a shorter
    conversation to render instead (the Responses API's `truncation: auto`), or None to keep
    it; the tools, and so the tool plan and grammar, stay the same. The conversation's images
    are read first (server/flow/images.py)."""
    tools = tool_plan(conversation)
    parser = tool_parser(state, engine) if tools is not None else None
    grammar = grammar_for(conversation.rules, tools, parser.name if parser else "hermes")
    images = await load_images(state.config.server, engine, conversation)
    prompt_ids, placed = render(engine, conversation, tools, images)
    while shorter is not None and (cut := shorter(len(prompt_ids))) is not None:
        prompt_ids, placed = render(engine, cut, tools, images)
    generation = replace(generation, prompts=[prompt_ids], grammar=grammar, images=placed)
    # a grammar shapes the output from its first token: no room for a thought
    reasoning = None if grammar else reasoning_plan(state, engine, prompt_ids)
    if conversation.thought_budget is not None and reasoning is not None:
        budget = thought_budget(engine, conversation.thought_budget, reasoning)
        generation = replace(generation, thought_budget=budget)
    answer = AnswerPlan(reasoning)
    if tools is not None and tools.parses:
        kept = 1 if not tools.parallel else conversation.max_calls
        answer = AnswerPlan(reasoning, parser, tools.determined_name, kept)
    return ConversationPlan(generation, tools, answer, images)


def reasoning_plan(
    state: ServerState, engine: AsyncEngine, prompt_ids: list[int]
) -> ReasoningPlan | None:
    """Whether (and where) this request's output holds a thought: the template thinks and the
    server reads thoughts; generation starts inside one when the prompt opened it."""
    tok = engine.tokenizer
    tags = thought_tags(tok.chat_template) if tok is not None else None
    if state.config.server.reasoning_parser == "none" or tok is None or tags is None:
        return None
    tail = tok.decode(prompt_ids[-16:], skip_special_tokens=False)
    return ReasoningPlan(opened_by_prompt(tail, tags), *tags)


def thought_budget(engine: AsyncEngine, asked: Budget, reasoning: ReasoningPlan) -> ThoughtBudget:
    """The budget in this tokenizer's ids; its end is forced as one token, so a tokenizer that
    spells `</think>` in several cannot bound a thought (a 400 naming the field)."""
    assert engine.tokenizer is not None
    opening, closing = reasoning.open, reasoning.close
    encode = engine.tokenizer.encode
    ids = {tag: encode(tag, add_special_tokens=False) for tag in (opening, closing)}
    if len(ids[closing]) != 1 or (not reasoning.inside and len(ids[opening]) != 1):
        why = f"this model's tokenizer spells {opening!r} or {closing!r} in several tokens"
        raise APIError(
            400, f"{asked.param}: {why}; its thought cannot be bounded", param=asked.param
        )
    open_id = None if reasoning.inside else ids[opening][0]
    return ThoughtBudget(asked.tokens, ids[closing][0], open_id)
