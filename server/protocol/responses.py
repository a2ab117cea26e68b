"""OpenAI's Responses API as pydantic models: the request (`ResponsesRequest`), the response
object, its output items and the stream events. Fields OpenAI defines that this server cannot
honour (hosted tools, background runs, prompt templates, conversations) are
declared so that setting them is a 400 naming them rather than silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.protocol.openai import TokenLogprob
from server.protocol.structured import JsonSchemaFormat


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputPart(_Base):
    """A content part of an input message: input_text / output_text carry text, input_image an
    image (`image_url`: a data: URL or a remote one; `detail` as chat's); other kinds
    (input_file, input_audio, an image by `file_id`) are refused by the route with a 400 naming
    the part."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class InputItem(_Base):
    """One item of `input`: a message (`type` may be omitted), a function call the model made
    earlier, or a function call's output."""

    # message, function_call, function_call_output; any other kind is a 400 naming it
    # (responses_items.input_items), not a validation error about the union
    type: str = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    namespace: str | None = None  # a function_call into a namespace tool
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    status: str | None = None
    # a reasoning item replayed: its summary, its text, or what `encrypted_content` carried
    summary: list[InputPart] | None = None
    encrypted_content: str | None = None

    @model_validator(mode="after")
    def _fields_of_type(self) -> InputItem:
        if self.type == "message" and (self.role is None or self.content is None):
            raise ValueError("a message item needs role and content")
        if self.type == "function_call" and (
            self.call_id is None or self.name is None or self.arguments is None
        ):
            raise ValueError("a function_call item needs call_id, name and arguments")
        if self.type == "function_call_output" and (self.call_id is None or self.output is None):
            raise ValueError("a function_call_output item needs call_id and output")
        return self


class FunctionTool(_Base):
    """A function tool, or a `namespace` of them (`tools`), or a hosted tool (`HOSTED_TOOLS`)."""

    type: str
    name: str | None = Field(default=None, pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's functions

    model_config = ConfigDict(extra="allow", strict=True)  # hosted tools' own settings, echoed


# Tools OpenAI runs on its side (search, a sandbox, image generation, remote MCP servers). This
# server runs none of them: they are accepted, echoed in the response's `tools`, and not offered
# to the model, which therefore never calls them (README: Responses). Codex CLI sends
# `web_search` by default; a 400 there is a Codex that cannot start.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "mcp",
    }
)


class NamedFunction(_Base):
    type: str
    name: str | None = None


class TextFormat(JsonSchemaFormat):
    """`text.format`: Chat Completions' json_schema format flattened beside its `type`."""

    type: Literal["text", "json_object", "json_schema"]


class TextParam(_Base):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(_Base):
    """For a model that thinks: `effort` "none" turns thinking off (the template's
    `enable_thinking`), any other effort on; `summary` adds the thought as the reasoning item's
    summary. For one that does not: no thought, so no reasoning item (and no reasoning tokens)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older name of `summary`


INCLUDE_LOGPROBS = "message.output_text.logprobs"
# What OpenAI lets a request include that comes only with items this server may not make
# (reasoning, from a model that thinks; hosted tools' results, images): included when made.
# Codex CLI sends `reasoning.encrypted_content` on every turn (it replays reasoning itself).
INCLUDE_EMPTY = frozenset(
    {
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed")


class ResponsesRequest(_Base):
    model: str = ""
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0)  # capped by max_top_logprobs
    text: TextParam | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vllm-router's P/D hand-over (kvserve)
    # declared to be refused when set (see the route)
    background: bool | None = None
    reasoning: Reasoning | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None


# ---- what the server sends ---------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[TokenLogprob]


class InputText(_Out):
    type: Literal["input_text"]
    text: str


class MessageItem(_Out):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant", "user", "system", "developer"]
    content: list[OutputText | InputText]


class FunctionCallItem(_Out):
    type: Literal["function_call"]
    id: str
    call_id: str
    namespace: str | None = None  # a call into a namespace tool's function
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallOutputItem(_Out):
    type: Literal["function_call_output"]
    id: str
    call_id: str
    output: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(_Out):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Out):
    """A thought: its text (`content`), the same as `summary` when one is asked for, and as
    `encrypted_content` (opaque to the client, for replay with `store: false`) when included."""

    type: Literal["reasoning"]
    id: str
    summary: list[ReasoningText]
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


OutputItem = ReasoningItem | MessageItem | FunctionCallItem
Item = ReasoningItem | MessageItem | FunctionCallItem | FunctionCallOutputItem


class InputTokensDetails(_Out):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(_Out):
    reasoning_tokens: int


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorInfo(_Out):
    code: str
    message: str


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(_Out):
    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["completed", "failed", "in_progress", "incomplete", "cancelled", "queued"]
    error: ResponseErrorInfo | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any] | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    service_tier: str
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer
    metadata: dict[str, str]
    background: bool


class ResponseDeleted(_Out):
    id: str
    object: Literal["response"]
    deleted: bool


class ItemList(_Out):
    object: Literal["list"]
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseEvent(_Out):
    """Every stream event: `type` and `sequence_number`, plus the fields of its kind."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputItem | None = None
    part: OutputText | ReasoningText | None = None
    summary_index: int | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
    logprobs: list[TokenLogprob] | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None
