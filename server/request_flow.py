"""What the generation routes share: admission, limits, salts and sessions, the fan-out of
`n` choices, disconnect handling, timing and usage."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.async_engine import AsyncEngine
from engine.sampling_params import ParamError
from server.errors import APIError
from server.generation import (
    Choice,
    admit,
    merged_outputs,
)
from server.plumbing import (
    ServerState,
    log,
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
    engine: AsyncEngine,
    choices: list[Choice],
    n: int,
    timing: Timing,
    req_id: str,
    timeout_s: float = 0.0,
) -> tuple[int, int, int]:
    """Run every choice to completion (non-streaming); returns prompt, completion and cached
    token counts."""
    async for _choice, out in merged_outputs(engine, choices, timeout_s):
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
