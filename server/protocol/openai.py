"""OpenAI request bodies as pydantic models, and the mapping to `SamplingParams`.

Unknown fields are ignored (as OpenAI and vLLM do); wrong types and out-of-range values become
400s naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.core.sampling_params import GrammarSpec, ParamError, SamplingParams
from server.protocol.structured import (
    AssistantToolCall,
    ChatTool,
    FunctionDef,
    FunctionName,
    LegacyFunctionCall,
    StructuredFields,
    ToolChoice,
)


class _Base(BaseModel):
    # strict: JSON types as the schema publishes them (no "1" for 1, no false for 0.0)
    model_config = ConfigDict(extra="ignore", strict=True)


class ImageURL(_Base):
    """An image part's image: a data: URL, or a remote URL the server may be allowed to fetch.
    `detail` is OpenAI's resolution hint: a vision model here reads every image at its one
    input size, which is what each value comes to."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Base):
    """A content part: text, or an image (`image_url`) for a vision model; other kinds
    (input_audio, file) are refused when the messages become turns (server/flow/chat_plan.py),
    with a 400 naming the part, as an image is for a text model."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None


# roles whose messages must carry content (OpenAI's schema: only the assistant's may be null
# or absent, when it carries tool calls instead)
_CONTENT_REQUIRED = ("system", "developer", "user", "tool")


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    function_call: LegacyFunctionCall | None = None  # legacy assistant turn
    reasoning_content: str | None = None  # an assistant turn's thought, for templates that keep it

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.role in _CONTENT_REQUIRED and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        if self.role == "function" and self.name is None:
            raise ValueError("a function message needs name")
        if self.role != "assistant" and (self.tool_calls or self.function_call):
            raise ValueError("only assistant messages carry tool_calls")
        return self


class StreamOptions(_Base):
    include_usage: bool = False


class SamplingFields(_Base):
    """The sampling fields every generating route's body comes to (OpenAI's names): chat's and
    completions' bodies are these and more; the Messages and Responses routes make one of
    theirs."""

    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # common extensions (vLLM names)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    # prefill/decode disaggregation (vLLM's field; server/kv_transfer.py)
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _null_is_default(self) -> SamplingFields:
        """OpenAI marks these nullable and SDKs send null: null means the default."""
        for name, default in _NULL_DEFAULTS.items():
            if name in type(self).model_fields and getattr(self, name) is None:
                setattr(self, name, default)
        return self

    @field_validator("stop", mode="after")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        seed_offset: int,
        grammar: GrammarSpec | None = None,
        **serving: Any,
    ) -> SamplingParams:
        """The body's sampling fields as engine parameters, with `serving`: what the flow
        decides beside them (the effective cache salt, prompt scoring, KV export, ...),
        validated once, together."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = float(value)
            except ValueError:
                raise ParamError(
                    "logit_bias", f"logit_bias key {key!r} is not a token id"
                ) from None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=None if self.seed is None else self.seed + seed_offset,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=bias,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            grammar=grammar,
            **{"cache_salt": self.cache_salt, **serving},
        )


class ChatCompletionRequest(SamplingFields, StructuredFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # a thinking model's thought, at most this many tokens (then its end is forced)
    thinking_budget: int | None = Field(default=None, ge=1)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = Field(default=None, min_length=1)  # legacy
    function_call: Literal["none", "auto"] | FunctionName | None = None  # legacy


class CompletionRequest(SamplingFields, StructuredFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0)
    suffix: str | None = None


# fields whose null means "the default" (the route reads them as plain values)
_NULL_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "stream": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "echo": False,
    "add_generation_prompt": True,
    "parallel_tool_calls": True,
}


# ---- responses (every JSON body the server sends is validated through one of these, so the
# published /openapi.json cannot drift from what the code returns) ----------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Out):
    cached_tokens: int
    image_tokens: int | None = None  # a vision model's image soft tokens (absent: none)


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class OutFunctionCall(_Out):
    name: str
    arguments: str


class OutToolCall(_Out):
    id: str
    type: Literal["function"]
    function: OutFunctionCall


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None
    reasoning_content: str | None = None  # a thinking model's thought (DeepSeek's, vLLM's name)
    tool_calls: list[OutToolCall] | None = None
    function_call: OutFunctionCall | None = None  # legacy `functions` requests


FinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason


class _CompletionHeader(_Out):
    """The fields a completion (chat or text, whole or a stream chunk) starts with; each class
    narrows `object` to its own name (the field keeps its place)."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None


class ChatCompletionResponse(_CompletionHeader):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer


class DeltaFunction(_Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunction | None = None  # legacy `functions` requests


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_CompletionHeader):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(_CompletionHeader):
    """Also the shape of each completion stream chunk (as OpenAI does it)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer
