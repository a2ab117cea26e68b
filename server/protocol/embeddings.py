"""/v1/embeddings bodies: the request (OpenAI's `CreateEmbeddingRequest`) and the response
(`CreateEmbeddingResponse`), apart from protocol.py to keep that module readable."""

from __future__ import annotations

from typing import Literal

from server.protocol.openai import _Base, _Out


class EmbeddingRequest(_Base):
    input: str | list[str] | list[int] | list[list[int]]
    model: str = ""
    dimensions: int | None = None  # truncate to this many, then re-normalise
    encoding_format: Literal["float", "base64"] | None = None  # null: float
    user: str | None = None  # OpenAI's end-user id: written to the request's log line


class Embedding(_Out):
    object: Literal["embedding"]
    # float: the vector; base64: its little-endian float32 bytes, base64-encoded (as OpenAI)
    embedding: list[float] | str
    index: int


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Out):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
