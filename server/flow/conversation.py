"""A conversation in no API's terms: what the generating routes map their bodies into (chat's
messages, Anthropic's content blocks, Responses items), and what the one prompt renderer
(`chat_prompt.py`), the tool plan and the grammar (`constraints.py`) read. Each value a client
can get wrong keeps the name the client's API gives it (`param`), so an error names the
client's own field as it is raised, with nothing renamed afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.grammar.structured_output import GrammarSpec

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class Call:
    """A tool call the assistant made earlier in the conversation."""

    id: str
    name: str
    arguments: str  # JSON text as sent: a call the cap cut off comes back unfinished


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image a client put in a turn, as sent: a data: URL (`data:image/png;base64,...`) or
    a remote URL; `param` is the part that holds it (`messages.0.content.1`)."""

    url: str
    param: str


@dataclass(slots=True)
class Turn:
    """One message: its role and text (None: an assistant turn that only calls), the calls it
    made, the call a tool result answers, and an assistant turn's thought. `source`: where the
    client put it (`messages.3`, `input.1`, `instructions`). `parts`: a turn with images, its
    text and images in the order sent (empty: the text alone)."""

    role: Role
    text: str | None
    calls: list[Call] = field(default_factory=list)
    call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # a participant's name; a legacy function result's function
    thought: str | None = None  # for templates that render an assistant turn's thought
    source: str = ""
    parts: tuple[str | ImageRef, ...] = ()


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model is offered, as the client declared it (`param`: `tools.2`,
    `functions.0`, `tools.1.tools.0`; `schema_param`: where its JSON schema is)."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None
    param: str
    schema_param: str

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates (and the fallback tool prompt) read it: OpenAI's shape,
        unset fields left out."""
        function = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Which call the model must make: none, auto, required, or the `named` function."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None
    param: str = "tool_choice"


@dataclass(frozen=True, slots=True)
class OutputRule:
    """A constraint the client put on the output, as a grammar, and the field that asked for it.
    `answer_format`: the answer's format (response_format and its kin), which may stand beside
    tools that constrain calls; other rules may not."""

    param: str
    spec: GrammarSpec
    answer_format: bool = False


@dataclass(frozen=True, slots=True)
class Budget:
    """A bound on the model's thought, in tokens, and the field that set it."""

    tokens: int
    param: str


@dataclass(frozen=True)
class Conversation:
    """What the model is asked: the turns, the tools offered and the choice among them, the
    rules on the output, the template's own variables (`enable_thinking`, ...) and a thought's
    budget. `param`: the field holding the turns (`messages`, `input`), which a template's
    refusal names; `max_calls`: how many calls of an answer are kept (None: all it makes)."""

    turns: list[Turn]
    param: str
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_calls: bool = True
    max_calls: int | None = None
    rules: tuple[OutputRule, ...] = ()
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thought_budget: Budget | None = None
    add_generation_prompt: bool = True
