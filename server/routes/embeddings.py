"""POST /v1/embeddings: each input is an embedding request on the engine (prefill only, batched
with everything else under the same token budget); its output is the pooled, L2-normalised final
hidden state (engine/runner/pooling.py). `dimensions` truncates and re-normalises here."""

from __future__ import annotations

import base64
import uuid

import torch
from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine
from engine.core.sampling_params import SamplingParams
from server.errors import APIError, RequestFailed
from server.flow.generation import Choice
from server.flow.plan import effective_salt
from server.flow.request_flow import Generation, admission_limit
from server.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from server.protocol.wire import parse_body, reply
from server.state import ServerState, log

MAX_INPUTS = 2048  # OpenAI's limit on the items of one request


def embedding_inputs(engine: AsyncEngine, body: EmbeddingRequest) -> list[list[int]]:
    """Token ids per input; empty inputs, empty strings and token lists are 400s naming
    `input` (lengths are checked by the engine's validation, also naming `input`)."""
    items = body.input
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]  # type: ignore[list-item]
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"input holds at most {MAX_INPUTS} items", param="input")
    out: list[list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param="input")
            item = engine.tokenizer.encode_for_embedding(item) if item else []
        if not item:
            raise APIError(400, f"input {i} is empty", param="input")
        out.append(list(item))  # type: ignore[arg-type]
    return out


def encode(vector: torch.Tensor, dimensions: int | None, fmt: str) -> list[float] | str:
    if dimensions is not None and dimensions < vector.shape[0]:
        vector = torch.nn.functional.normalize(vector[:dimensions].float(), dim=-1)  # unit L2
    if fmt == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def embeddings(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    cfg = state.config.server
    body = await parse_body(request, EmbeddingRequest, cfg.max_body_bytes)
    state.check_model(body.model)
    engine = state.ready_engine()
    hidden = engine.info.hidden_size
    if body.dimensions is not None and not 1 <= body.dimensions <= hidden:
        raise APIError(
            400, f"dimensions must be in [1, {hidden}] for this model", param="dimensions"
        )
    inputs = embedding_inputs(engine, body)
    limit = admission_limit(state)
    if len(inputs) > limit:  # would never be admitted: not a 429 to retry
        raise APIError(400, f"this server embeds at most {limit} inputs per request", param="input")
    params = SamplingParams(
        max_tokens=1,
        pooling=engine.info.pooling,
        cache_salt=effective_salt(state, request, None),
        lora=state.adapter(body.model),
    )
    req_id = f"embd-{uuid.uuid4().hex}"
    choices = [Choice(i, p, params, f"{req_id}-{i}") for i, p in enumerate(inputs)]
    gen = Generation.admit(state, engine, choices, 1, req_id)
    fmt = body.encoding_format or "float"
    if body.user:  # OpenAI's end-user id: attribution, in the request's log line
        log.info("%s user=%r", req_id, body.user)

    def respond(usage: dict) -> Response:
        data = []
        for ch in choices:
            if ch.embedding is None:
                raise RequestFailed(
                    f"request {ch.request_id} ended without an embedding: {ch.finish_reason}"
                )
            vector = encode(ch.embedding, body.dimensions, fmt)
            data.append({"object": "embedding", "embedding": vector, "index": ch.index})
        tokens = usage["prompt_tokens"]
        return reply(
            EmbeddingResponse,
            {
                "object": "list",
                "data": data,
                "model": gen.head["model"],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    return await gen.collect(request, respond)
