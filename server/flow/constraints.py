"""What a request asks its output to be, as one grammar for the engine: `response_format`,
vLLM's `structured_outputs` / `guided_*`, or a tool call that must be made (`tool_choice`
"required" or a named function), read from the neutral conversation (server/flow/conversation.py).
Several at once is a 400 naming them; so is a tool choice that cannot be honoured. Free tool use
(`auto`) needs no grammar: the output is parsed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.grammar.structured_output import GrammarSpec
from server.errors import APIError
from server.flow.conversation import Conversation, OutputRule, Tool
from server.protocol.schema_limits import schema_limit_error
from server.protocol.structured import StructuredFields


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    name: str | None  # the named function
    parallel: bool

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def determined_name(self) -> str | None:
        """The function a forced call must name, where the grammar leaves one choice (a named
        tool_choice, or `required` with one tool): a call the token cap cuts before its name is
        still that call."""
        if self.choice == "named":
            return self.name
        if self.choice == "required" and len(self.tools) == 1:
            return self.tools[0].name
        return None


def tool_plan(conversation: Conversation) -> ToolPlan | None:
    """The conversation's tools, the choice among them and whether calls may be parallel;
    None when it offers no tools."""
    tools, choice = conversation.tools, conversation.tool_choice
    if not tools:
        if choice is not None and choice.mode != "none":
            raise APIError(400, f"{choice.param} needs tools to choose from", param=choice.param)
        return None
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise APIError(400, f"{tool.param}: tool names must be unique", param=tool.param)
        seen.add(tool.name)
    parallel = conversation.parallel_calls
    if choice is not None and choice.mode == "named":
        if choice.name not in seen:
            raise APIError(
                400,
                f"{choice.param} names {choice.name!r}, which is not among the tools "
                f"({', '.join(t.name for t in tools)})",
                param=choice.param,
            )
        return ToolPlan(tools, "named", choice.name, parallel)
    return ToolPlan(tools, choice.mode if choice is not None else "auto", None, parallel)


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise APIError(400, f"{param}: the schema is not valid JSON", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema is an object", param=param)
    check_schema_size(schema, param)
    return json.dumps(schema, sort_keys=True)


def check_schema_size(schema: Any, param: str) -> None:
    error = schema_limit_error(schema)
    if error is not None:
        raise APIError(
            400, f"{param}: the schema is too large: {error}", param=param, code="schema_too_large"
        )


def schema_spec(schema: dict[str, Any] | str, param: str) -> GrammarSpec:
    """A JSON schema the output must follow, checked (`param`: the field it came in)."""
    return GrammarSpec("json_schema", _schema_text(schema, param))


def requested(body: StructuredFields) -> list[OutputRule]:
    """Every constraint an OpenAI body names (response_format, vLLM's structured_outputs and
    guided_* fields), with the parameter that named it."""
    found: list[OutputRule] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(OutputRule("response_format", GrammarSpec("json_object", ""), True))
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError(
                    400,
                    "response_format json_schema needs json_schema.schema",
                    param="response_format.json_schema",
                )
            spec = schema_spec(rf.json_schema.json_schema, "response_format")
            found.append(OutputRule("response_format", spec, True))
    so = body.structured_outputs
    if so is not None:
        kinds = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object or None,
        }
        for key, value in kinds.items():
            if value is not None:
                param = f"structured_outputs.{key}"
                found.append(OutputRule(param, _spec(key, value, param)))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append(OutputRule(f"guided_{key}", _spec(key, value, f"guided_{key}")))
    return found


def _spec(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec("json_schema", _schema_text(value, param))
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "choice":
        if not all(isinstance(c, str) for c in value):
            raise APIError(400, f"{param}: choices are strings", param=param)
        return GrammarSpec("choice", json.dumps(value))
    return GrammarSpec(kind, value)  # regex, grammar (EBNF / Lark)


def tool_call_spec(
    plan: ToolPlan, parser_name: str, answer: GrammarSpec | None = None
) -> GrammarSpec:
    """The calls `required` / a named choice must produce, or (auto with `strict` tools) the
    shape any call the model chooses to make must have, in the parser's format. `answer`
    (response_format beside the tools): the output is such calls or one answer in that JSON
    format, as OpenAI serves an agent with tools and an output type."""
    tools = [t for t in plan.tools if plan.name is None or t.name == plan.name]
    for t in tools:
        check_schema_size(t.parameters or {}, t.schema_param)
    payload = {
        "format": parser_name,  # engine/grammar/structured_output.py: CALL_FORMATS
        "mode": "free" if plan.choice == "auto" else "forced",
        "parallel": plan.parallel and plan.name is None,
        **({"answer": _answer_schema(answer)} if answer is not None else {}),
        "tools": [
            {"name": t.name, "parameters": t.parameters or {"type": "object"}} for t in tools
        ],
    }
    return GrammarSpec("tool_calls", json.dumps(payload, sort_keys=True))


def _answer_schema(spec: GrammarSpec) -> dict[str, Any]:
    return json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}


def grammar_for(
    rules: list[OutputRule] | tuple[OutputRule, ...],
    plan: ToolPlan | None = None,
    parser_name: str = "hermes",
) -> tuple[GrammarSpec, str] | None:
    """The one grammar a request's output must follow and the parameter that asked for it.
    Tools that constrain (required, named, strict) and the answer's format combine into one
    grammar, calls or an answer in the format; other pairs of constraints are a 400."""
    found = list(rules)
    calls_param = None
    if plan is not None and plan.choice in ("required", "named"):
        calls_param = "tool_choice"
    elif plan is not None and plan.choice == "auto" and any(t.strict for t in plan.tools):
        calls_param = "tools"  # strict: calls follow their schemas
    if plan is not None and calls_param is not None:
        if len(found) == 1 and found[0].answer_format:
            return tool_call_spec(plan, parser_name, answer=found[0].spec), calls_param
        found.append(OutputRule(calls_param, tool_call_spec(plan, parser_name)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(r.param for r in found)
        raise APIError(
            400, f"one output constraint per request; this one names {names}", param=found[1].param
        )
    return found[0].spec, found[0].param
