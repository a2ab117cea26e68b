"""Anthropic's Messages API as pydantic models: the request (`MessagesRequest`, also what
`/v1/messages/count_tokens` takes), the message it answers with, the stream's events, and the
error body. Unknown fields are ignored, as Anthropic's SDKs send newer ones first; wrong types
and out-of-range values are 400s naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# what a model can take from a message (images: a vision model); documents and search results
# are refused by the route with a 400 naming the block
TEXT_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image")


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class AnthropicImageSource(_Base):
    """An image block's picture: base64 data of a media type, or a URL (fetched only from the
    server's allowed_media_domains)."""

    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _fields_of_type(self) -> AnthropicImageSource:
        if self.type == "base64" and (self.media_type is None or self.data is None):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and self.url is None:
            raise ValueError("a url image source needs url")
        return self

    def as_url(self) -> str:
        """The picture as one URL: base64 data as a data: URL."""
        if self.type == "url":
            assert self.url is not None
            return self.url
        return f"data:{self.media_type};base64,{self.data}"


class AnthropicCacheControl(_Base):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class AnthropicContentBlock(_Base):
    """A message's content block; which fields a type needs is checked here, which types serve
    is the route's (TEXT_BLOCKS)."""

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[AnthropicContentBlock] | None = None
    is_error: bool | None = None
    # thinking (replayed history)
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    source: AnthropicImageSource | None = None  # image
    cache_control: AnthropicCacheControl | None = None

    @model_validator(mode="after")
    def _fields_of_type(self) -> AnthropicContentBlock:
        needs = {
            "text": ("text",),
            "tool_use": ("id", "name", "input"),
            "tool_result": ("tool_use_id",),
            "thinking": ("thinking",),
            "image": ("source",),
        }
        missing = [f for f in needs.get(self.type, ()) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        return self


class AnthropicInputMessage(_Base):
    """A turn. Claude Code 2.1 sends `system` turns inside `messages` (instructions at that
    point of the conversation); they are the chat template's system messages."""

    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicContentBlock]


class AnthropicTool(_Base):
    """A client tool. Anthropic's server tools (web search, code execution, ...) carry a
    `type` other than "custom"; the route refuses them (this server runs no tools)."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_\-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: AnthropicCacheControl | None = None


class AnthropicToolChoice(_Base):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type tool needs a name")
        return self


class AnthropicThinking(_Base):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class AnthropicOutputFormat(_Base):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(_Base):
    """`effort` steers how hard a reasoning model thinks (this one does not: honoured as is);
    `format` is a JSON schema the answer must follow (grammar-enforced, as chat's
    response_format)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AnthropicOutputFormat | None = None


class AnthropicMetadata(_Base):
    user_id: str | None = None


class MessagesRequest(_Base):
    model: str = ""
    messages: list[AnthropicInputMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[AnthropicContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: AnthropicMetadata | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    cache_control: AnthropicCacheControl | None = None  # a breakpoint at the last cacheable block
    # one tier here: both of Anthropic's values are what it serves
    service_tier: Literal["auto", "standard_only"] | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(default=1, ge=1)  # not part of a count


# ---- what the server sends ---------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AnthropicTextBlock(_Out):
    type: Literal["text"]
    text: str


class AnthropicThinkingBlock(_Out):
    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseBlock(_Out):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(_Out):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    service_tier: str | None = None


class AnthropicMessage(_Out):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicStreamEvent(_Out):
    """One server-sent event: `type` names it (message_start, content_block_start, ping,
    content_block_delta, content_block_stop, message_delta, message_stop, error)."""

    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicTokenCount(_Out):
    input_tokens: int


class AnthropicErrorDetail(_Out):
    type: str
    message: str


class AnthropicError(_Out):
    type: Literal["error"]
    error: AnthropicErrorDetail
