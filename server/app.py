"""The Starlette application: routes, auth, CORS, body limits, and the OpenAI wire format."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.sampling_params import ParamError
from engine.scoring import score_prompt
from models.chat_template import TemplateError
from server.config import Config
from server.errors import APIError, error_body
from server.generation import (
    Choice,
    RequestFailed,
    admit,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    merged_outputs,
    usage,
)
from server.metrics import Metrics
from server.openapi import build_openapi
from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    StatusResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from server.sessions import SessionTracker

VERSION = "0.1.0"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger("kvserve.server")


class ServerState:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.metrics = Metrics(lambda: self.engine.engine if self.engine else None)
        self.created = int(time.time())
        self.sessions = SessionTracker()
        self.draining = False  # SIGTERM received: finish in-flight work, admit nothing new
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def model_name(self) -> str:
        if self.config.server.served_model_name:
            return self.config.server.served_model_name
        if not self.config.engine.model:
            return DEFAULT_MODEL_NAME
        name = os.path.basename(os.path.normpath(self.config.engine.model))
        return name.removesuffix(".gguf")

    def ready_engine(self) -> AsyncEngine:
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        if self.engine is None:
            raise APIError(503, "the model is still loading", code="model_loading")
        if self.engine.dead is not None:
            raise APIError(
                503, "the engine has failed; the server is restarting", code="engine_dead"
            )
        return self.engine


# ---- middleware ---------------------------------------------------------------------------------


UI_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui")


def _public(path: str) -> bool:
    """Routes served without the API key: liveness and the static page (which asks for the key
    and sends it on every API call)."""
    return path in ("/health", "/") or path.startswith("/ui/")


class GuardMiddleware:
    """API key (constant-time) on every route but /health and preflight; 413 on large bodies."""

    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int) -> None:
        self.app, self.max_body = app, max_body_bytes
        self.keys = [k.strip().encode() for k in api_key.split(",") if k.strip()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v for k, v in scope["headers"]}
        if self.keys and scope["method"] != "OPTIONS" and not _public(scope["path"]):
            auth = headers.get("authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            # compare against every key so the time taken does not say which one nearly matched
            if not sum(hmac.compare_digest(token, key) for key in self.keys):
                resp = APIError(
                    401,
                    "Incorrect or missing API key. Pass it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                ).response()
                return await resp(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            resp = APIError(
                413,
                f"request body of {int(length)} bytes exceeds the limit of {self.max_body} bytes",
                code="body_too_large",
            ).response()
            return await resp(scope, receive, send)
        await self.app(scope, receive, send)


# ---- helpers ------------------------------------------------------------------------------------


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    raw = await request.body()
    if len(raw) > limit:
        raise APIError(413, f"request body exceeds the limit of {limit} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_from_loc(err["loc"])
        raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "none"}


def _param_from_loc(loc: tuple) -> str | None:
    """pydantic locations name union members ("prompt", "list[int]", 0); keep the field path."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


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


def check_model(state: ServerState, name: str) -> None:
    if name and name != state.model_name:
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )


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


def checked(model: type[BaseModel], data: dict) -> dict:
    """Pass a response body through its protocol model: what we send is what we publish."""
    return model.model_validate(data).model_dump(mode="json", exclude_unset=True)


def reply(model: type[BaseModel], data: dict, status: int = 200) -> JSONResponse:
    return JSONResponse(checked(model, data), status_code=status)


def sse(data: dict | str, model: type[BaseModel] | None = None) -> bytes:
    if model is not None and isinstance(data, dict):
        data = checked(model, data)
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


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


def prompt_usage(choices: list[Choice], n: int) -> tuple[int, int, int]:
    firsts = choices[::n]
    return (
        sum(len(c.prompt_ids) for c in firsts),
        sum(len(c.token_ids) for c in choices),
        sum(c.num_cached_tokens for c in firsts),
    )


# ---- chat completions ---------------------------------------------------------------------------


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
        return StreamingResponse(
            chat_stream(state, engine, choices, head, body.n, include_usage, timing, session),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def collect() -> Response:
        async for _choice, out in merged_outputs(engine, choices):
            if out.new_token_ids:
                timing.token()
        p, c, cached = prompt_usage(choices, body.n)
        timing.done(req_id, p, cached, c)
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


# ---- completions --------------------------------------------------------------------------------


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
        return StreamingResponse(
            completion_stream(
                state, engine, choices, head, body, prompt_texts, include_usage, timing
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def collect() -> Response:
        async for _choice, out in merged_outputs(engine, choices):
            if out.new_token_ids:
                timing.token()
        p, c, cached = prompt_usage(choices, body.n)
        timing.done(req_id, p, cached, c)
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


# ---- small routes -------------------------------------------------------------------------------


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    if state.load_error is not None:
        return reply(StatusResponse, {"status": "failed", "error": str(state.load_error)}, 503)
    if state.engine is None:
        return reply(StatusResponse, {"status": "loading"}, 503)
    if state.engine.dead is not None:
        return reply(StatusResponse, {"status": "dead", "error": str(state.engine.dead)}, 503)
    if state.draining:
        return reply(StatusResponse, {"status": "draining"}, 503)
    return reply(
        StatusResponse,
        {"status": "ok", "attention_backend": state.engine.engine.backend_cls.name},
    )


async def index(request: Request) -> Response:
    return FileResponse(os.path.join(UI_DIR, "index.html"))


async def stats(request: Request) -> Response:
    """A snapshot for the page's live panel. Read without locking from the engine thread's
    objects: a view may be a step stale, never wrong for long."""
    state: ServerState = request.app.state.kv
    engine = state.ready_engine().engine
    pool, sched = engine.kv.pool, engine.scheduler
    cells = ["2" if b.ref_cnt else ("1" if b.block_hash is not None else "0") for b in pool.blocks]
    host = engine.host
    return JSONResponse(
        {
            "model": state.model_name,
            "time": time.time(),
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "generation_tokens": engine.stats.generation_tokens,
            "prompt_tokens": engine.stats.prompt_tokens,
            "prefix_cache_queries": engine.kv.prefix_queries,
            "prefix_cache_hits": engine.kv.prefix_hits,
            "num_blocks": pool.num_blocks,
            "block_size": engine.block_size,
            "blocks_in_use": cells.count("2"),
            "block_map": "".join(cells),
            "host": None
            if host is None
            else {"used_bytes": host.used_bytes, "capacity_bytes": host.capacity_bytes},
        }
    )


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


def model_card(state: ServerState) -> dict:
    engine = state.ready_engine().engine
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "kvserve",
        "max_model_len": engine.max_model_len,
    }


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    return reply(ModelList, {"object": "list", "data": [model_card(state)]})


async def get_model(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    name = request.path_params["model"]
    if name != state.model_name:
        raise APIError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )
    return reply(ModelCard, model_card(state))


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body: TokenizeRequest = await parse_body(
        request, TokenizeRequest, state.config.server.max_body_bytes
    )
    check_model(state, body.model)
    engine = state.ready_engine().engine
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    if body.messages is not None:
        try:
            text = engine.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.text()} for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
            )
        except (TemplateError, ValueError) as e:
            raise APIError(400, str(e), param="messages") from None
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
    elif body.prompt is not None:
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise APIError(400, "either prompt or messages is required", param="prompt")
    return reply(
        TokenizeResponse, {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
    )


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body: DetokenizeRequest = await parse_body(
        request, DetokenizeRequest, state.config.server.max_body_bytes
    )
    check_model(state, body.model)
    engine = state.ready_engine().engine
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    vocab = engine.spec.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return reply(
        DetokenizeResponse,
        {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)},
    )


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def reset_prefix_cache(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    ok = await state.ready_engine().call(lambda e: e.reset_prefix_cache())
    if not ok:
        raise APIError(409, "cannot reset the prefix cache while requests run")
    return JSONResponse({"status": "ok"})


# ---- errors and assembly ------------------------------------------------------------------------


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    msg = "route not found" if exc.status_code == 404 else str(exc.detail)
    return JSONResponse(
        error_body(exc.status_code, f"{msg}: {request.method} {request.url.path}"),
        status_code=exc.status_code,
    )


async def server_error(request: Request, exc: Exception) -> Response:
    ref = uuid.uuid4().hex[:12]
    log.exception("internal error %s on %s %s", ref, request.method, request.url.path)
    return JSONResponse(
        error_body(500, f"internal server error (reference {ref})"), status_code=500
    )


def _wrap(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except EngineDeadError as e:
            return APIError(503, str(e), code="engine_dead").response()
        except ParamError as e:
            return APIError(400, str(e), param=e.param).response()
        except RequestFailed as e:
            return APIError(500, str(e), code="request_failed").response()
        except Exception:
            ref = uuid.uuid4().hex[:12]
            log.exception("request %s failed on %s %s", ref, request.method, request.url.path)
            return APIError(
                500,
                f"internal error processing the request (request id {ref})",
                code="internal_error",
            ).response()

    return run


async def offload_idle_sessions(state: ServerState) -> None:
    """Move idle sessions' KV to the host tier before the device pool needs their blocks."""
    idle = state.config.server.idle_seconds
    while True:
        await asyncio.sleep(max(0.2, idle / 4))
        engine = state.engine
        if engine is None or engine.dead is not None or engine.engine.host is None:
            continue
        for sid, session in state.sessions.idle(idle):
            ids, salt = session.token_ids, session.cache_salt
            moved = await engine.call(lambda e, ids=ids, salt=salt: e.offload_prefix(ids, salt))
            session.offloaded = True
            log.debug("session %s idle %.0fs: %d blocks offloaded to host", sid, idle, moved)


def build_app(
    config: Config,
    engine: AsyncEngine | None = None,
    load: bool = True,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> Starlette:
    """The app. With `engine=None` and `load=True` the engine loads in a background thread at
    startup while /health answers 503."""
    state = ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        state.loop = loop
        if engine is not None:
            engine.on_death = engine.on_death or on_fatal
            engine.start(loop)
            state.engine = engine
        elif load:

            def load_engine() -> None:
                try:
                    eng = AsyncEngine.from_config(config.engine)
                    eng.on_death = on_fatal
                    eng.start(loop)
                    state.engine = eng
                    log.info("model loaded: ready")
                except BaseException as e:  # noqa: BLE001
                    log.exception("model failed to load")
                    state.load_error = e
                    if on_fatal is not None:
                        on_fatal(e)

            threading.Thread(target=load_engine, name="kvserve-load", daemon=True).start()
        offloader = None
        if config.server.idle_seconds > 0:
            offloader = asyncio.create_task(offload_idle_sessions(state))
        yield
        if offloader is not None:
            offloader.cancel()
        if state.engine is not None:
            state.engine.shutdown()

    routes = [
        Route("/health", health),
        Route("/", index),
        Mount("/ui", app=StaticFiles(directory=UI_DIR), name="ui"),
        Route("/v1/stats", _wrap(stats)),
        Route("/version", version),
        Route("/openapi.json", openapi),
        Route("/v1/models", _wrap(list_models)),
        Route("/v1/models/{model:path}", _wrap(get_model)),
        Route("/v1/chat/completions", _wrap(chat_completions), methods=["POST"]),
        Route("/v1/completions", _wrap(completions), methods=["POST"]),
        Route("/tokenize", _wrap(tokenize), methods=["POST"]),
        Route("/detokenize", _wrap(detokenize), methods=["POST"]),
        Route("/metrics", metrics),
        Route("/reset_prefix_cache", _wrap(reset_prefix_cache), methods=["POST"]),
    ]
    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=config.server.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        ),
        Middleware(
            GuardMiddleware,
            api_key=config.server.api_key,
            max_body_bytes=config.server.max_body_bytes,
        ),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: api_error,
            HTTPException: http_error,
            Exception: server_error,
        },
    )
    app.state.kv = state
    app.state.openapi = build_openapi(VERSION)
    return app
