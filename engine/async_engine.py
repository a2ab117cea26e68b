"""The engine loop in its own thread, with an asyncio front.

Requests and aborts enter through a thread-safe inbox; each step's outputs go back to the asyncio
loop in one `call_soon_threadsafe` batch and are routed to per-request queues. Nothing on the
asyncio side ever waits on a model forward. If the loop thread dies, every waiting request gets
the error and `dead` is set so /health can report it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine")


class EngineDeadError(RuntimeError):
    pass


class EngineShutdownError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_death: Callable[[BaseException], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_death = on_death
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def run_here(self, loop: asyncio.AbstractEventLoop, on_ready: Callable[[], None]) -> None:
        """Run the engine loop in the calling thread until shutdown; `on_ready` runs first.

        Why: call this from the thread that built the engine, so that one thread does all
        torch work. Each thread that runs parallel torch ops gets its own OpenMP team, and a
        second team on the same cores (the loader's, idle but alive) made MKL's matmuls here
        ~2x slower in the stepping thread (a batch-1 step 31 -> 70 ms)."""
        self._loop = loop
        self._thread = threading.current_thread()
        on_ready()
        self._run()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.dead is None:
            self.engine.shutdown()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- asyncio side ------------------------------------------------------------------------

    def open(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Admit a request now (synchronously, so admission control counts it at once) and
        return its output queue. The queue is dropped when the request finishes, even if
        nobody ever reads it."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead}")
        self.engine.validate_prompt(prompt_token_ids, params)
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id}")
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = q
        self._inbox.put(("add", request_id, prompt_token_ids, params))
        return q

    async def stream(
        self, request_id: str, q: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        """Yield deltas until the request finishes. Leaving early (client gone, task cancelled)
        aborts the request, which frees its blocks at the next step."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        q = self.open(request_id, prompt_token_ids, params)
        async for out in self.stream(request_id, q):
            yield out

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def abort_all(self, message: str) -> None:
        """End every request now; their streams get `message` as an error event."""
        self._inbox.put(("abort_all", message))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (scoring, cache reset, stats)."""
        fut: Future[Any] = Future()
        self._inbox.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    # ---- engine thread -----------------------------------------------------------------------

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for request_id, item in items:
            done = isinstance(item, BaseException) or item.finished
            q = self._queues.pop(request_id, None) if done else self._queues.get(request_id)
            if q is not None:
                q.put_nowait(item)

    def _post(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _handle(self, msg: tuple[Any, ...], out: list) -> None:
        kind = msg[0]
        if kind == "add":
            _, request_id, ids, params = msg
            try:
                self.engine.add_request(request_id, ids, params)
            except Exception as e:  # invalid after all: fail just this request
                out.append((request_id, e))
        elif kind == "abort":
            result = self.engine.abort_request(msg[1])
            if result is not None:
                out.append((msg[1], result))
        elif kind == "abort_all":
            for request_id in list(self.engine.scheduler.requests):
                self.engine.abort_request(request_id)
                out.append((request_id, EngineShutdownError(msg[1])))
        elif kind == "call":
            _, fn, fut = msg
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                out: list[tuple[str, RequestOutput | BaseException]] = []
                if not self.engine.has_unfinished():
                    self._handle(self._inbox.get(), out)  # idle: block until something arrives
                while True:
                    try:
                        self._handle(self._inbox.get_nowait(), out)
                    except queue.Empty:
                        break
                if self.engine.has_unfinished():
                    out.extend((o.request_id, o) for o in self.engine.step())
                self._post(out)
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            log.critical("engine loop died:\n%s", traceback.format_exc())
            self.dead = e
            err = EngineDeadError(f"engine loop died: {e!r}")
            self._post([(rid, err) for rid in list(self._queues)])
            for rid in list(self.engine.scheduler.requests):
                self.engine.scheduler.finish(rid, FinishReason.ERROR)
            if self.on_death is not None:
                self.on_death(e)
