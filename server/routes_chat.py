"""POST /v1/chat/completions, streaming or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine, EngineDeadError
from models.chat_template import TemplateError
from server.errors import APIError, error_body
from server.generation import (
    Choice,
    chat_logprobs,
    finish_reason,
    merged_outputs,
    usage,
)
from server.plumbing import (
    VERSION,
    ServerState,
    check_model,
    parse_body,
    reply,
    sse,
)
from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ErrorResponse,
)
from server.request_flow import (
    Timing,
    admit_or_429,
    check_limits,
    effective_salt,
    event_stream,
    make_choices,
    prompt_usage,
    run_or_disconnect,
    run_to_end,
    session_id,
)


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body: ChatCompletionRequest = await parse_body(
        request, ChatCompletionRequest, state.config.server.max_body_bytes
    )
    check_model(state, body.model)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(
                400, "logprobs must be true when top_logprobs is set", param="top_logprobs"
            )
        if body.top_logprobs > state.config.server.max_top_logprobs:
            raise APIError(
                400,
                f"top_logprobs must be at most {state.config.server.max_top_logprobs}",
                param="top_logprobs",
            )
    check_limits(state, body)
    engine = state.ready_engine()
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer; use /v1/completions with token ids")
    messages = [
        {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
        for m in body.messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
    except (TemplateError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    body.cache_salt = effective_salt(state, request, body.cache_salt)
    session = session_id(request, body.user)
    state.sessions.begin_turn(session, ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req_id = f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = body.max_completion_tokens or body.max_tokens
    choices = make_choices(state, body, [ids], logprobs, req_id, max_tokens)
    admit_or_429(state, choices)
    created = int(time.time())
    timing = Timing(state)
    head = {
        "id": req_id,
        "created": created,
        "model": state.model_name,
        "system_fingerprint": f"kvserve-{VERSION}",
    }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(
            chat_stream(state, engine, choices, head, body.n, include_usage, timing, session),
        )

    async def collect() -> Response:
        p, c, cached = await run_to_end(
            engine, choices, body.n, timing, req_id, state.config.server.request_timeout_s
        )
        state.sessions.end_turn(
            session, choices[0].prompt_ids + choices[0].token_ids, choices[0].params.cache_salt
        )
        return reply(
            ChatCompletionResponse,
            {
                **head,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": ch.index,
                        "message": {"role": "assistant", "content": ch.text, "refusal": None},
                        "logprobs": chat_logprobs(tokenizer, ch.logprobs)
                        if logprobs is not None
                        else None,
                        "finish_reason": finish_reason(ch.finish_reason),
                    }
                    for ch in choices
                ],
                "usage": usage(p, c, cached),
            },
        )

    return await run_or_disconnect(request, collect())


async def chat_stream(
    state: ServerState,
    engine: AsyncEngine,
    choices: list[Choice],
    head: dict,
    n: int,
    include_usage: bool,
    timing: Timing,
    session: str | None = None,
) -> AsyncIterator[bytes]:
    tokenizer = engine.engine.tokenizer
    assert tokenizer is not None
    extra = {"usage": None} if include_usage else {}

    def chunk(choice_list: list[dict]) -> bytes:
        return sse(
            {**head, "object": "chat.completion.chunk", "choices": choice_list, **extra},
            ChatCompletionChunk,
        )

    for ch in choices:
        yield chunk(
            [
                {
                    "index": ch.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    try:
        async for ch, out in merged_outputs(engine, choices, state.config.server.request_timeout_s):
            if out.new_token_ids:
                timing.token()
            if out.new_text or out.logprobs:
                lp = (
                    chat_logprobs(tokenizer, out.logprobs)
                    if ch.params.logprobs is not None
                    else None
                )
                yield chunk(
                    [
                        {
                            "index": ch.index,
                            "delta": {"content": out.new_text},
                            "logprobs": lp,
                            "finish_reason": None,
                        }
                    ]
                )
            if out.finished:
                yield chunk(
                    [
                        {
                            "index": ch.index,
                            "delta": {},
                            "logprobs": None,
                            "finish_reason": finish_reason(out.finish_reason),
                        }
                    ]
                )
    except (EngineDeadError, RuntimeError) as e:
        yield sse(error_body(500, f"generation failed: {e}", code="engine_error"), ErrorResponse)
        yield sse("[DONE]")
        return
    p, c, cached = prompt_usage(choices, n)
    timing.done(head["id"], p, cached, c)
    state.sessions.end_turn(
        session, choices[0].prompt_ids + choices[0].token_ids, choices[0].params.cache_salt
    )
    if include_usage:
        yield sse(
            {
                **head,
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": usage(p, c, cached),
            },
            ChatCompletionChunk,
        )
    yield sse("[DONE]")
