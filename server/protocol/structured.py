"""Request fields for tools and structured outputs: OpenAI's `tools`, `tool_choice`,
`parallel_tool_calls`, `response_format` and the legacy `functions` / `function_call`; vLLM's
`structured_outputs` and its older `guided_*` names."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDef(_Base):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Base):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Base):
    name: str = Field(default="response", pattern=r"^[a-zA-Z0-9_\-]{1,64}$")
    description: str | None = None
    # `schema` is a BaseModel attribute name; the wire name stays "schema"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Base):
    """vLLM's `structured_outputs` (one of these set)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class ToolCallFunction(_Base):
    name: str
    arguments: str


class AssistantToolCall(_Base):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class LegacyFunctionCall(_Base):
    name: str
    arguments: str = "{}"


class StructuredFields(_Base):
    """Mixed into chat (tools) and both generation routes (formats)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
