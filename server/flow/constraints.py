"""What a request asks its output to be, as one grammar for the engine: `response_format`,
vLLM's `structured_outputs` / `guided_*`, or a tool call that must be made (`tool_choice`
"required" or a named function). Several at once is a 400 naming them; so is a tool choice that
cannot be honoured. Free tool use (`auto`) needs no grammar: the output is parsed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.grammar.structured_output import GrammarSpec
from server.errors import APIError
from server.protocol.schema_limits import schema_limit_error
from server.protocol.structured import ChatTool, NamedToolChoice, StructuredFields


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[ChatTool]
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
            return self.tools[0].function.name
        return None


def tool_plan(body: Any) -> ToolPlan | None:
    """`tools`/`tool_choice`/`parallel_tool_calls`, or the legacy `functions`/`function_call`
    mapped onto them."""
    tools, choice, param = body.tools, body.tool_choice, "tool_choice"
    if body.functions is not None:
        if tools is not None:
            raise APIError(400, "send tools or functions, not both", param="functions")
        tools = [ChatTool(type="function", function=f) for f in body.functions]
    if body.function_call is not None:
        if choice is not None:
            raise APIError(
                400, "send tool_choice or function_call, not both", param="function_call"
            )
        choice, param = body.function_call, "function_call"
        if not isinstance(choice, str):
            choice = NamedToolChoice(type="function", function=choice)
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, f"{param} needs tools to choose from", param=param)
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool names must be unique", param="tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(
                400,
                f"{param} names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})",
                param=param,
            )
        return ToolPlan(tools, "named", choice.function.name, body.parallel_tool_calls)
    return ToolPlan(tools, choice or "auto", None, body.parallel_tool_calls)


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
        raise APIError(400, f"{param}: the schema is too large: {error}", param=param,
                       code="schema_too_large")  # fmt: skip


def _requested(body: StructuredFields) -> list[tuple[str, GrammarSpec | None]]:
    """Every constraint the body names, with the parameter that named it."""
    found: list[tuple[str, GrammarSpec | None]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", GrammarSpec("json_object", "")))
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError(
                    400,
                    "response_format json_schema needs json_schema.schema",
                    param="response_format.json_schema",
                )
            found.append(
                (
                    "response_format",
                    GrammarSpec(
                        "json_schema",
                        _schema_text(rf.json_schema.json_schema, "response_format"),
                    ),
                )
            )
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
                found.append(
                    (f"structured_outputs.{key}", _spec(key, value, f"structured_outputs.{key}"))
                )
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _spec(key, value, f"guided_{key}")))
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
    for i, t in enumerate(plan.tools):
        if plan.name is None or t.function.name == plan.name:
            check_schema_size(t.function.parameters or {}, f"tools.{i}.function.parameters")
    tools = [t for t in plan.tools if plan.name is None or t.function.name == plan.name]
    payload = {
        "format": parser_name,  # engine/grammar/structured_output.py: CALL_FORMATS
        "mode": "free" if plan.choice == "auto" else "forced",
        "parallel": plan.parallel and plan.name is None,
        **({"answer": _answer_schema(answer)} if answer is not None else {}),
        "tools": [
            {"name": t.function.name, "parameters": t.function.parameters or {"type": "object"}}
            for t in tools
        ],
    }
    return GrammarSpec("tool_calls", json.dumps(payload, sort_keys=True))


def _answer_schema(spec: GrammarSpec) -> dict[str, Any]:
    return json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}


def grammar_for(
    body: StructuredFields, plan: ToolPlan | None = None, parser_name: str = "hermes"
) -> tuple[GrammarSpec, str] | None:
    """The one grammar a request's output must follow and the parameter that asked for it.
    Tools that constrain (required, named, strict) and response_format combine into one
    grammar, calls or an answer in the format; other pairs of constraints are a 400."""
    found = _requested(body)
    calls_param = None
    if plan is not None and plan.choice in ("required", "named"):
        calls_param = "tool_choice"
    elif plan is not None and plan.choice == "auto" and any(t.function.strict for t in plan.tools):
        calls_param = "tools"  # strict: calls follow their schemas
    if plan is not None and calls_param is not None:
        if len(found) == 1 and found[0][0] == "response_format" and found[0][1] is not None:
            return tool_call_spec(plan, parser_name, answer=found[0][1]), calls_param
        found.append((calls_param, tool_call_spec(plan, parser_name)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise APIError(
            400, f"one output constraint per request; this one names {names}", param=found[1][0]
        )
    param, spec = found[0]
    assert spec is not None
    return spec, param
