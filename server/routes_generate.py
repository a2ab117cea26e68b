"""The generation routes: /v1/chat/completions and /v1/completions, streaming or not."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.sampling_params import ParamError
from engine.scoring import score_prompt
from models.chat_template import TemplateError
from server.errors import APIError, error_body
from server.generation import (
    Choice,
    admit,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    merged_outputs,
    usage,
)
from server.plumbing import (
    VERSION,
    ServerState,
    check_model,
    log,
    parse_body,
    reply,
    sse,
)
from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)


def effective_salt(state: ServerState, request: Request, salt: str | None) -> str | None:
    """With salt_cache_per_key, the caller's API key enters the cache salt, so tenants holding
    different keys never share KV blocks (and cannot probe each other's prompts by timing)."""
    if not state.config.server.salt_cache_per_key:
        return salt
    auth = request.headers.get("authorization", "")
    key_tag = hashlib.sha256(auth.encode()).hexdigest()[:16]
    return f"key:{key_tag}|{salt or ''}"


def session_id(request: Request, user: str | None) -> str | None:
    return request.headers.get("x-session-id") or user


def check_limits(state: ServerState, body: Any, n_prompts: int = 1) -> None:
    cfg = state.config.server
    if body.n > cfg.max_n:
        raise APIError(400, f"n must be at most {cfg.max_n}", param="n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > cfg.max_stop_sequences:
        raise APIError(400, f"at most {cfg.max_stop_sequences} stop sequences", param="stop")
    if any(len(s) > cfg.max_stop_length for s in stops):
        raise APIError(
            400, f"stop sequences are limited to {cfg.max_stop_length} characters", param="stop"
        )


def admit_or_429(state: ServerState, choices: list[Choice]) -> None:
    limit = state.config.engine.max_num_seqs + state.config.server.max_queue_len
    if not admit(state.ready_engine(), choices, limit):
        raise APIError(
            429,
            "the server is at capacity; retry shortly",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


async def until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def run_or_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await work, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    finally:
        watcher.cancel()


def make_choices(
    state: ServerState,
    body: Any,
    prompts: list[list[int]],
    logprobs: int | None,
    req_id: str,
    max_tokens: int | None,
) -> list[Choice]:
    engine = state.ready_engine().engine
    choices = []
    for p_idx, ids in enumerate(prompts):
        budget = max_tokens if max_tokens is not None else max(1, engine.max_model_len - len(ids))
        for i in range(body.n):
            try:
                params = body.sampling_params(budget, logprobs, seed_offset=i)
                engine.validate_prompt(ids, params)
            except ParamError as e:
                raise APIError(400, str(e), param=e.param, code="invalid_value") from None
            index = p_idx * body.n + i
            choices.append(Choice(index, ids, params, f"{req_id}-{index}"))
    return choices


class Timing:
    """Per-request latency observations for the Prometheus histograms and the log line."""

    def __init__(self, state: ServerState) -> None:
        self.metrics = state.metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.ttft: float | None = None

    def token(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.ttft = now - self.start
            self.metrics.ttft.observe(self.ttft)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self, req_id: str, prompt_tokens: int, cached: int, completion: int) -> None:
        e2e = time.monotonic() - self.start
        self.metrics.e2e.observe(e2e)
        log.info(
            "%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft=%.3fs e2e=%.3fs",
            req_id,
            prompt_tokens,
            cached,
            completion,
            self.ttft or 0.0,
            e2e,
        )


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def run_to_end(
    engine: AsyncEngine, choices: list[Choice], n: int, timing: Timing, req_id: str
) -> tuple[int, int, int]:
    """Run every choice to completion (non-streaming); returns prompt, completion and cached
    token counts."""
    async for _choice, out in merged_outputs(engine, choices):
        if out.new_token_ids:
            timing.token()
    p, c, cached = prompt_usage(choices, n)
    timing.done(req_id, p, cached, c)
    return p, c, cached


def prompt_usage(choices: list[Choice], n: int) -> tuple[int, int, int]:
    firsts = choices[::n]
    return (
        sum(len(c.prompt_ids) for c in firsts),
        sum(len(c.token_ids) for c in choices),
        sum(c.num_cached_tokens for c in firsts),
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
        p, c, cached = await run_to_end(engine, choices, body.n, timing, req_id)
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
        async for ch, out in merged_outputs(engine, choices):
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


def completion_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    tokenizer = state.ready_engine().engine.tokenizer
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
            out.append(tokenizer.encode(p))
        else:
            out.append(list(p))  # type: ignore[arg-type]
    return out


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body: CompletionRequest = await parse_body(
        request, CompletionRequest, state.config.server.max_body_bytes
    )
    check_model(state, body.model)
    if body.logprobs is not None and body.logprobs > state.config.server.max_top_logprobs:
        raise APIError(
            400,
            f"logprobs must be at most {state.config.server.max_top_logprobs}",
            param="logprobs",
        )
    prompts = completion_prompts(state, body)
    check_limits(state, body, len(prompts))
    body.cache_salt = effective_salt(state, request, body.cache_salt)
    engine = state.ready_engine()
    tokenizer = engine.engine.tokenizer
    req_id = f"cmpl-{uuid.uuid4().hex}"
    choices = make_choices(state, body, prompts, body.logprobs, req_id, body.max_tokens or 16)
    head = {
        "id": req_id,
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": f"kvserve-{VERSION}",
    }
    timing = Timing(state)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""

    prompt_texts = [decode(p) for p in prompts]
    echo_lps: list[dict | None] = [None] * len(prompts)
    if body.echo and body.logprobs is not None and tokenizer is not None:
        for i, ids in enumerate(prompts):
            echo_lps[i] = await prompt_logprobs(engine, ids, body.logprobs)
    admit_or_429(state, choices)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(
            completion_stream(
                state, engine, choices, head, body, prompt_texts, include_usage, timing
            ),
        )

    async def collect() -> Response:
        p, c, cached = await run_to_end(engine, choices, body.n, timing, req_id)
        out_choices = []
        for ch in choices:
            p_idx = ch.index // body.n
            prefix = prompt_texts[p_idx] if body.echo else ""
            lps = None
            if body.logprobs is not None and tokenizer is not None:
                lps = completion_logprobs(tokenizer, list(ch.logprobs), ch.token_ids, len(prefix))
                if body.echo and echo_lps[p_idx] is not None:
                    lps = merge_logprobs(echo_lps[p_idx], lps)
            out_choices.append(
                {
                    "index": ch.index,
                    "text": prefix + ch.text,
                    "logprobs": lps,
                    "finish_reason": finish_reason(ch.finish_reason),
                }
            )
        return reply(
            CompletionResponse,
            {
                **head,
                "object": "text_completion",
                "choices": out_choices,
                "usage": usage(p, c, cached),
            },
        )

    return await run_or_disconnect(request, collect())


async def prompt_logprobs(engine: AsyncEngine, ids: list[int], top: int) -> dict:
    def run(e: LLMEngine) -> tuple[list[float], list[list[tuple[int, float]]]]:
        lp = score_prompt(e, ids).log_softmax(-1)
        idx = __import__("torch").tensor(ids[1:])
        chosen = lp[:-1].gather(1, idx[:, None])[:, 0].tolist() if len(ids) > 1 else []
        tops = []
        if top > 0 and len(ids) > 1:
            vals, ind = lp[:-1].topk(top, dim=-1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(ind.tolist(), vals.tolist(), strict=True)
            ]
        return chosen, tops

    chosen, tops = await engine.call(run)
    from engine.sampler import TokenLogprobs

    entries: list[TokenLogprobs | None] = [None] + [
        TokenLogprobs(t, lp, tops[k] if tops else [])
        for k, (t, lp) in enumerate(zip(ids[1:], chosen, strict=True))
    ]
    tokenizer = engine.engine.tokenizer
    assert tokenizer is not None
    return completion_logprobs(tokenizer, entries, ids, 0)


def merge_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


async def completion_stream(
    state: ServerState,
    engine: AsyncEngine,
    choices: list[Choice],
    head: dict,
    body: CompletionRequest,
    prompt_texts: list[str],
    include_usage: bool,
    timing: Timing,
) -> AsyncIterator[bytes]:
    tokenizer = engine.engine.tokenizer
    extra = {"usage": None} if include_usage else {}
    offsets = {ch.index: 0 for ch in choices}

    def chunk(index: int, text: str, lps: dict | None, reason: str | None) -> bytes:
        return sse(
            {
                **head,
                "object": "text_completion",
                **extra,
                "choices": [
                    {"index": index, "text": text, "logprobs": lps, "finish_reason": reason}
                ],
            },
            CompletionResponse,
        )

    if body.echo:
        for ch in choices:
            text = prompt_texts[ch.index // body.n]
            offsets[ch.index] = len(text)
            yield chunk(ch.index, text, None, None)
    try:
        async for ch, out in merged_outputs(engine, choices):
            if out.new_token_ids:
                timing.token()
            lps = None
            if body.logprobs is not None and tokenizer is not None and out.logprobs:
                lps = completion_logprobs(
                    tokenizer, list(out.logprobs), out.new_token_ids, offsets[ch.index]
                )
            offsets[ch.index] += len(out.new_text)
            if out.new_text or lps:
                yield chunk(ch.index, out.new_text, lps, None)
            if out.finished:
                yield chunk(ch.index, "", None, finish_reason(out.finish_reason))
    except (EngineDeadError, RuntimeError) as e:
        yield sse(error_body(500, f"generation failed: {e}", code="engine_error"), ErrorResponse)
        yield sse("[DONE]")
        return
    p, c, cached = prompt_usage(choices, body.n)
    timing.done(head["id"], p, cached, c)
    if include_usage:
        yield sse(
            {**head, "object": "text_completion", "choices": [], "usage": usage(p, c, cached)},
            CompletionResponse,
        )
    yield sse("[DONE]")
