"""The one generation flow every route shares. A route turns its body into a `GenerationPlan`;
`start` validates it (limits, grammar), salts it, opens its session turn, makes its choices,
does the KV hand-over and admits it; the `Generation` then runs to its end (collect) or as a
stream in the route's `StreamFormat`, with timing, usage, timeouts, failures and disconnects
handled once. Routes only translate in and format out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.async_engine import AsyncEngine
from engine.core.images import PromptImage
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import GrammarSpec, ParamError, SamplingParams
from engine.grammar.budget import GrammarBusyError
from server.errors import (
    APIError,
    RequestFailed,
    RequestRefused,
    RequestTimeout,
    error_body,
    to_api_error,
)
from server.flow.generation import Choice, usage_of
from server.flow.plan import (
    GenerationPlan,
    app_name,
    check_limits,
    effective_salt,
    make_choices,
    renamed,
)
from server.kv_transfer import TransferDirections
from server.protocol.admin import ErrorResponse
from server.protocol.wire import SSE_DONE, sse
from server.state import VERSION, ServerState, log


async def compile_grammar(
    state: ServerState, engine: AsyncEngine, spec: GrammarSpec, param: str
) -> None:
    """The request's grammar, compiled within the server's budget (a 400 naming the limit), or
    a 503 when too many wait to compile, or a 504 past the request's own timeout."""
    timeout = state.config.server.request_timeout_s
    try:
        await engine.compile_grammar(spec, param, timeout or None)
    except GrammarBusyError as e:
        raise APIError(
            503, f"{e}; retry later", code="grammar_compiler_busy", headers={"Retry-After": "1"}
        ) from None
    except TimeoutError:
        raise RequestTimeout(
            f"request exceeded the {timeout:g} s limit waiting to compile its grammar"
        ) from None


async def start(
    state: ServerState, engine: AsyncEngine, request: Request, plan: GenerationPlan
) -> Generation:
    """The one flow from a plan to an admitted request: limits, grammar, salt, session,
    choices, KV hand-over, admission (or a 400/429 naming the route's own parameter)."""
    body = plan.body
    try:
        transfer = state.kv_transfer.directions(plan.kv_transfer_params)
        lora = state.adapter(body.model)
        check_limits(state, body)
        salt = effective_salt(state, request, body.cache_salt)
        app = app_name(request, body) if state.config.server.app_cache_stats else None
        if app is not None and lora is not None:  # an adapter's hits are counted apart
            app = f"{app}@{lora.name}"[:96]
        choices = make_choices(engine, plan, salt, app, transfer.publish, lora)
        if plan.grammar is not None:
            await compile_grammar(state, engine, *plan.grammar)
        publish = await kv_handover(
            state, engine, choices, body.n, plan.kv_transfer_params, transfer
        )
    except (APIError, ParamError) as e:
        raise renamed(to_api_error(e), plan.param_names) from None
    on_done = None
    if plan.session is not None:
        session = plan.session
        state.sessions.begin_turn(session, plan.prompts[0])

        def on_done(done: list[Choice]) -> None:
            first = done[0]
            state.sessions.end_turn(
                session,
                first.prompt_ids + first.token_ids,
                first.params.cache_namespace,
                first.images,
            )

    return Generation.admit(state, engine, choices, body.n, plan.req_id, on_done, publish)


class StreamFormat(Protocol):
    """How one API words its event stream: the events before any output, for each output, at
    the end (`usage` of every choice) and on a failure after the headers went out."""

    def begin(self, gen: Generation) -> list[bytes]: ...
    def step(self, choice: Choice, out: RequestOutput) -> list[bytes]: ...
    def end(self, gen: Generation, usage: dict) -> list[bytes]: ...
    def fail(self, gen: Generation, error: dict) -> list[bytes]: ...


class ChoiceChunks:
    """Chat's and completions' stream: one chunk per choice event, an optional usage chunk,
    then `[DONE]`. Subclasses word a choice's opening, deltas and closing."""

    model: type[BaseModel]
    object: str

    def __init__(self, include_usage: bool) -> None:
        self.include_usage = include_usage
        self.base: dict = {}

    def opening(self, choice: Choice) -> dict | None:
        return None

    def delta(self, choice: Choice, out: RequestOutput) -> dict | None:
        raise NotImplementedError

    def closing(self, choice: Choice, out: RequestOutput) -> dict:
        raise NotImplementedError

    def _chunk(self, choices: list[dict], **extra: Any) -> bytes:
        return sse(self.model, {**self.base, "choices": choices, **extra})

    def begin(self, gen: Generation) -> list[bytes]:
        usage = {"usage": None} if self.include_usage else {}
        self.base = {**gen.head, "object": self.object, **usage}
        openings = [self.opening(ch) for ch in gen.choices]
        return [self._chunk([o]) for o in openings if o is not None]

    def step(self, choice: Choice, out: RequestOutput) -> list[bytes]:
        delta = self.delta(choice, out)
        events = [self._chunk([delta])] if delta is not None else []
        if out.finished:
            events.append(self._chunk([self.closing(choice, out)]))
        return events

    def end(self, gen: Generation, usage: dict) -> list[bytes]:
        tail = [self._chunk([], usage=usage)] if self.include_usage else []
        return [*tail, SSE_DONE]

    def fail(self, gen: Generation, error: dict) -> list[bytes]:
        body = error_body(500, error["message"], code=error["code"])
        return [sse(ErrorResponse, body), SSE_DONE]


def stream_error(e: BaseException) -> dict:
    """A failure after the stream began, as every route reports it: `code` is server_error
    (OpenAI's code for a failed generation), the message says what happened."""
    return {"code": "server_error", "message": f"generation failed: {e}"}


@dataclass
class Generation:
    """One admitted request: its choices on the engine, and the head every body repeats."""

    state: ServerState
    engine: AsyncEngine
    choices: list[Choice]
    n: int
    head: dict
    queue: asyncio.Queue
    on_done: Callable[[list[Choice]], None] | None = None
    # a prefill instance's last act: publish the prompts' KV; returns `kv_transfer_params`
    publish: Callable[[], Awaitable[dict]] | None = None
    # when the choices entered the engine: the start of the request's TTFT and e2e
    submitted: float = field(default_factory=time.monotonic)

    @classmethod
    def admit(
        cls,
        state: ServerState,
        engine: AsyncEngine,
        choices: list[Choice],
        n: int,
        req_id: str,
        on_done: Callable[[list[Choice]], None] | None = None,
        publish: Callable[[], Awaitable[dict]] | None = None,
    ) -> Generation:
        """Every choice enters the engine now, or the request gets a 429."""
        submitted = time.monotonic()
        q = submit_or_429(
            state,
            engine,
            [(c.request_id, c.prompt_ids, c.params) for c in choices],
            {c.request_id: c.images for c in choices if c.images},
        )
        lora = choices[0].params.lora if choices else None
        head = {
            "id": req_id,
            "created": int(time.time()),
            # what served it: the base model, or the LoRA adapter the request named
            "model": lora.name if lora is not None else state.model_name,
            "system_fingerprint": f"kvserve-{VERSION}",
        }
        return cls(state, engine, choices, n, head, q, on_done, publish, submitted)

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's deltas in arrival order, accumulated into its `Choice`."""
        timeout = self.state.config.server.request_timeout_s
        by_id = {c.request_id: c for c in self.choices}
        timing = Timing(self.state, self.submitted)
        try:
            async for out in self.engine.stream(list(by_id), self.queue, timeout):
                choice = by_id[out.request_id]
                if out.finish_reason == "error":
                    failed = RequestRefused if out.client_error else RequestFailed
                    raise failed(f"request {choice.request_id} failed: {out.error}")
                timing.output(out)
                if choice.app is not None and out.prefix_hit is not None:
                    self.state.app_cache.observe(
                        choice.app, choice.prompt_ids, out.prefix_hit, choice.params.cache_namespace
                    )
                    choice.app = None  # once per prompt
                choice.add(out)
                yield choice, out
        except TimeoutError:
            raise RequestTimeout(f"request exceeded the {timeout:g} s limit") from None
        usage = usage_of(self.choices, self.n)
        timing.done(self.head["id"], usage)
        if self.on_done is not None:
            self.on_done(self.choices)

    async def collect(self, request: Request, respond: Callable[[dict], Response]) -> Response:
        """Run every choice to its end; `respond(usage)` builds the body. A client that leaves
        first aborts them (499, which nobody reads)."""

        async def run() -> Response:
            async for _ in self.outputs():
                pass
            if self.publish is not None:
                self.head["kv_transfer_params"] = await self.publish()
            return respond(usage_of(self.choices, self.n))

        return await run_or_disconnect(request, run())

    def stream(self, fmt: StreamFormat) -> StreamingResponse:
        return StreamingResponse(
            self._events(fmt),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def _events(self, fmt: StreamFormat) -> AsyncIterator[bytes]:
        for event in fmt.begin(self):
            yield event
        try:
            async for ch, out in self.outputs():
                for event in fmt.step(ch, out):
                    yield event
            if self.publish is not None:  # a stream has no place for the params: publish only
                await self.publish()
            last = fmt.end(self, usage_of(self.choices, self.n))
        except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
            if to_api_error(e) is None:
                log.exception("stream %s failed", self.head["id"])
            for event in fmt.fail(self, stream_error(e)):
                yield event
            return
        for event in last:
            yield event


async def kv_handover(
    state: ServerState,
    engine: AsyncEngine,
    choices: list[Choice],
    n: int,
    params: dict | None,
    directions: TransferDirections,
) -> Callable[[], Awaitable[dict]] | None:
    """Disaggregation around one request (server/kv_transfer.py): a decode instance fetches the
    prompts' published KV now, before admission; on a prefill instance each prompt's first
    choice hands its blocks back when it ends (`export_kv`, set when the choices were made), and
    the publishing step runs then."""
    transfer = state.kv_transfer
    firsts = choices[::n]  # one choice per prompt
    if directions.fetch:
        for c in firsts:
            sent = params if len(firsts) == 1 else None
            await transfer.fetch(engine, c.prompt_ids, c.params.cache_namespace, sent, c.images)
    if not directions.publish:
        return None

    async def publish() -> dict:
        answers = [await transfer.publish(engine, c.kv_blocks or []) for c in firsts]
        return answers[0]

    return publish


def admission_limit(state: ServerState) -> int:
    """The most engine requests in flight at once: running, plus the waiting queue."""
    return state.config.engine.max_num_seqs + state.config.server.max_queue_len


def submit_or_429(
    state: ServerState,
    engine: AsyncEngine,
    requests: list[tuple[str, list[int], SamplingParams]],
    images: dict[str, tuple[PromptImage, ...]] | None = None,
) -> asyncio.Queue:
    """Admit all of a request's engine requests now, or answer 429 (queue full)."""
    q = engine.submit(requests, admission_limit(state), images)
    if q is None:
        raise APIError(
            429,
            "the server is at capacity; retry shortly",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    return q


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


class Timing:
    """Per-request latency observations for the Prometheus histograms and the log line."""

    def __init__(self, state: ServerState, start: float) -> None:
        """`start`: when the request entered the engine (its arrival there, as vLLM counts
        TTFT: the route's planning before it is not in these figures)."""
        self.metrics = state.metrics
        self.start = start
        self.last: float | None = None
        self.ttft: float | None = None
        self.queued = False
        # the engine's own share of the first token: waiting for a step, then the prefill
        self.queue_time: float | None = None
        self.prefill_time: float | None = None

    def output(self, out: RequestOutput) -> None:
        kind = "cached" if out.num_cached_tokens else "cold"
        if not self.queued and out.queue_time is not None:
            self.metrics.queue.labels(kind).observe(out.queue_time)
            self.queued = True
            self.queue_time = out.queue_time
        if not out.new_token_ids:
            return
        now = time.monotonic()
        if self.last is None:
            self.ttft = now - self.start
            self.metrics.ttft.observe(self.ttft)
            if out.prefill_time is not None:
                self.metrics.prefill.labels(kind).observe(out.prefill_time)
                self.prefill_time = out.prefill_time
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self, req_id: str, usage: dict) -> None:
        e2e = time.monotonic() - self.start
        self.metrics.e2e.observe(e2e)
        log.info(
            "%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft=%.3fs queue=%.3fs "
            "prefill=%.3fs e2e=%.3fs",
            req_id,
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"],
            self.ttft or 0.0,
            self.queue_time or 0.0,
            self.prefill_time or 0.0,
            e2e,
        )
