"""Bodies of the routes around generation (server/routes/admin.py): tokenize and detokenize, the
model list in the shapes both SDKs read, health, and OpenAI's error body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from server.protocol.openai import ChatMessage
from server.protocol.structured import ChatTool


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Base):
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # as chat's, for the same prompt


class EmptyRequest(_Base):
    """A POST route that takes no fields (e.g. /reset_prefix_cache): any body must still be
    well-formed JSON."""


class LoadLoRARequest(_Base):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Base):
    """vLLM's POST /v1/unload_lora_adapter (its `lora_int_id` is accepted and not needed:
    the name is the adapter's identity here)."""

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(_Base):
    model: str = ""
    tokens: list[int]


class ModelCard(_Out):
    """A model in the shape both SDKs read: OpenAI's (object, created, owned_by) and
    Anthropic's (type, display_name, created_at) side by side, so a client of either lists it."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    type: Literal["model"]
    display_name: str
    created_at: str  # RFC 3339
    root: str  # what serves it: the checkpoint's path, or the LoRA adapter's (vLLM's field)
    parent: str | None  # a LoRA adapter's base model (None: a base model)


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]
    # Anthropic's paging fields (one page: every model this server serves)
    has_more: bool
    first_id: str | None
    last_id: str | None


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Out):
    prompt: str


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class StatusResponse(_Out):
    status: str
    attention_backend: str | None = None
    error: str | None = None
