"""The engine loop in its own thread, with an asyncio front.

`AsyncEngine` is the only door from asyncio to the engine: submit (`open`/`generate`), `stream`,
`abort`, `call` (a function run on the engine thread between steps), `snapshot` (plain data for
stats and metrics), and `info`/`tokenizer`, which are immutable. Requests and aborts enter through
a thread-safe inbox; each step's outputs go back to the asyncio loop in one
`call_soon_threadsafe` batch and are routed to per-request queues. Nothing on the asyncio side
ever waits on a model forward. If the loop thread dies, every waiting request and call gets the
error and `dead` is set so /health can report it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from engine.config import EngineConfig
from engine.core.engine_info import EngineInfo
from engine.core.images import PromptImage
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import GrammarSpec, LoRARef, ParamError, SamplingParams
from engine.core.snapshot import EngineSnapshot
from engine.grammar.budget import GrammarBudget
from engine.kv.remote import KVStoreError, Prefetch, RedisBlockStore
from engine.kv.sparse_log import should_log
from engine.lora.registry import LoRALimits
from models.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")


class EngineDeadError(RuntimeError):
    pass


class EngineShutdownError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_death: Callable[[BaseException], None] | None = None
    ) -> None:
        self._core = engine  # touched only on the engine thread
        self.info: EngineInfo = engine.info
        self.tokenizer: Tokenizer | None = engine.tokenizer  # immutable; safe from any thread
        self.image_processor = engine.image_processor  # immutable too (None: text only)
        self.vision = engine.vision
        # thread-safe parts, held from the start so the asyncio side never reads `_core`: the
        # grammar compiler, and the prefix hasher (its root is fixed at startup)
        self._structured = engine.structured
        self._hasher = engine.kv.hasher
        self._loras = engine.loras  # its `refs` snapshot is replaced whole: read from any thread
        self.grammar_budget: GrammarBudget | None = None
        self._remote: RedisBlockStore | None = None
        self._failed_puts = 0  # counted on the event loop (publish), logged sparsely
        self.on_death = on_death
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        if engine.tp is not None:  # a lost rank is fatal, even while the engine idles
            engine.tp.on_lost = lambda error: self._inbox.put(("fatal", error))

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
            self._core.shutdown()
        elif self._core.tp is not None:
            self._core.tp.close()
        if self._remote is not None:
            self._remote.close()
        if self.grammar_budget is not None:
            self.grammar_budget.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    # ---- asyncio side ------------------------------------------------------------------------

    def submit(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        max_in_flight: int | None = None,
        images: dict[str, tuple[PromptImage, ...]] | None = None,
    ) -> asyncio.Queue[RequestOutput | BaseException] | None:
        """Admit requests (request id, prompt token ids, params; `images`: a request's prompt
        images by its id) all at once, now, so admission
        control counts them at once, or none of them (None) if that would put more than
        `max_in_flight` requests in flight. Their outputs share the returned queue; read it
        with `stream`. Raises ParamError if a request does not fit the engine."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead}")
        if max_in_flight is not None and len(self._queues) + len(requests) > max_in_flight:
            return None
        images = images or {}
        for request_id, ids, params in requests:
            self.info.validate(ids, params, images.get(request_id, ()))
            if request_id in self._queues:
                raise ValueError(f"duplicate request id {request_id}")
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # arrival is now, not when the engine thread reads its inbox (the end of the step it is
        # in): queue time and the deadline order count the wait for that step too
        arrival = time.monotonic()
        for request_id, ids, params in requests:
            self._queues[request_id] = q
            self._inbox.put(("add", request_id, ids, params, arrival, images.get(request_id, ())))
        return q

    async def stream(
        self,
        request_ids: Sequence[str],
        q: asyncio.Queue[RequestOutput | BaseException],
        timeout_s: float = 0.0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the requests' deltas, in arrival order, until all have finished. An error for
        any of them is raised here; past `timeout_s` (0: none) TimeoutError is. Leaving early
        (an error, the client gone, a cancelled task) aborts the unfinished ones, which frees
        their blocks at the next step."""
        pending = set(request_ids)
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        try:
            while pending:
                if deadline is None:
                    item = await q.get()
                else:
                    item = await asyncio.wait_for(q.get(), deadline - time.monotonic())
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            for request_id in pending:
                if self._queues.pop(request_id, None) is not None:
                    self._inbox.put(("abort", request_id))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        q = self.submit([(request_id, prompt_token_ids, params)])
        assert q is not None
        async for out in self.stream([request_id], q):
            yield out

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def abort_all(self, message: str) -> None:
        """End every request now; their streams get `message` as an error event."""
        self._inbox.put(("abort_all", message))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (scoring, cache reset, offload)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead}")
        fut: Future[Any] = Future()
        self._inbox.put(("call", fn, fut))
        if self.dead is not None:  # died between the check and the put: nobody will run it
            self._fail_pending_calls(EngineDeadError(f"engine loop died: {self.dead}"))
        return await asyncio.wrap_future(fut)

    @property
    def loras(self) -> dict[str, LoRARef]:
        """The LoRA adapters served now, by name (a snapshot)."""
        return self._loras.refs

    @property
    def lora_paths(self) -> dict[str, str]:
        return self._loras.paths

    @property
    def lora_limits(self) -> LoRALimits:
        return self._loras.limits

    async def load_lora(self, name: str, path: str) -> LoRARef:
        """Read and check an adapter off the engine thread, then serve it (LoRAError)."""
        adapter = await asyncio.to_thread(self._loras.read, path)
        return await self.call(lambda e: e.add_lora(name, adapter))

    async def unload_lora(self, name: str) -> None:
        """KeyError if not loaded; LoRAInUse while requests use it."""
        await self.call(lambda e: e.remove_lora(name))

    def budget_grammar_compiles(self, budget_s: float, workers: int) -> None:
        """From now on a grammar compiles within `budget_s` seconds, at most `workers` at once
        (engine/grammar/budget.py); worker processes start now."""
        if self._structured is not None and budget_s > 0:
            self.grammar_budget = GrammarBudget(self._structured, budget_s, workers)

    async def compile_grammar(
        self, spec: GrammarSpec, param: str, timeout_s: float | None = None
    ) -> None:
        """Compile (and so validate and cache) a grammar off both the event loop and the engine
        thread, within the budget if one is set: ParamError naming `param` if it cannot be
        compiled (GrammarBusyError, TimeoutError: waited too long for a compile slot). The
        engine's matcher for the request then finds it in the cache."""
        if self._structured is None:
            raise ParamError(param, "structured outputs are not available on this server")
        if self.grammar_budget is not None:
            await self.grammar_budget.compile(spec, param, timeout_s)
        else:
            await asyncio.to_thread(self._structured.compile, spec, param)

    async def snapshot(self) -> EngineSnapshot:
        return await self.call(LLMEngine.snapshot)

    async def reset_prefix_cache(self) -> bool:
        return await self.call(LLMEngine.reset_prefix_cache)

    async def import_blocks(self, blocks: list[tuple[bytes, bytes]]) -> int:
        return await self.call(lambda core: core.import_blocks(blocks))

    async def offload_prefix(
        self, token_ids: list[int], cache_salt: str | None, images: tuple[PromptImage, ...] = ()
    ) -> int:
        return await self.call(lambda e: e.offload_prefix(token_ids, cache_salt, images))

    # ---- the remote KV tier (engine/kv/remote.py) --------------------------------------------

    def open_remote(self, url: str, ttl_s: int, secret: str = "") -> None:
        """Connect the remote tier (once; later calls keep the first store). `secret`: the key
        every instance sharing the store holds (kv_store_key); values are authenticated with
        it, else only digested (engine/kv/remote.py)."""
        if self._remote is None:
            info = self.info
            self._remote = RedisBlockStore(
                url, info.kv_namespace, info.host_block_bytes, ttl_s, secret=secret
            )

    async def prefetch(
        self,
        prompt_ids: list[int],
        cache_salt: str | None,
        max_blocks: int | None = None,
        last_block_hash: str | None = None,
        images: tuple[PromptImage, ...] = (),
    ) -> Prefetch:
        """Bring the prompt's blocks the remote store holds, and this instance lacks, into the
        host tier before the request is admitted: its prefix-cache walk then meets them there.
        `max_blocks` / `last_block_hash`: what the publishing instance said it put (a chain
        that ends elsewhere is another tokenization or seed: nothing is fetched). Never raises
        for the store."""
        assert self._remote is not None, "open_remote first"
        bs = self.info.block_size
        # the last prompt token is always recomputed (the request needs its logits)
        hashes = self._hasher.hashes(prompt_ids, cache_salt, images)[: (len(prompt_ids) - 1) // bs]
        expected = len(hashes) if max_blocks is None else min(len(hashes), max_blocks)
        if expected and last_block_hash and hashes[expected - 1].hex() != last_block_hash:
            log.warning(
                "kv transfer: the prefill instance's block hashes differ from ours "
                "(another kv_hash_seed or tokenization?); computing the prompt here"
            )
            return Prefetch(fallbacks=("hash_mismatch",))
        # the publisher put less than the prompt (a failed put, fewer blocks held)
        fallbacks = ("not_published",) if expected < len(hashes) else ()
        have = await self.call(lambda core: core.kv.num_cached_prefix(hashes[:expected]))
        wanted = hashes[have:expected]
        if not wanted:
            return Prefetch(fallbacks=fallbacks)
        t = time.monotonic()
        try:
            payloads, refused = await asyncio.to_thread(self._remote.get_run, wanted)
        except KVStoreError as e:
            log.warning("kv transfer: %s; computing the prompt here", e)
            return Prefetch(len(wanted), fallbacks=(*fallbacks, "store_error"))
        stored = await self.import_blocks(list(zip(wanted, payloads, strict=False)))
        if refused:  # a value that failed its tag: the run stopped there (the store counted it)
            fallbacks = (*fallbacks, "integrity")
        elif stored < len(wanted):
            fallbacks = (*fallbacks, "missing_blocks")
        nbytes = sum(len(p) for p in payloads[:stored])
        return Prefetch(len(wanted), stored, nbytes, time.monotonic() - t, fallbacks, refused)

    async def publish(self, blocks: list[tuple[bytes, bytes]]) -> bool:
        """Put a finished prompt's blocks (hash, payload), exported by the engine in the step
        that ended it, in the remote store; False when the store failed (logged)."""
        assert self._remote is not None, "open_remote first"
        try:
            await asyncio.to_thread(self._remote.put, blocks)
        except KVStoreError as e:
            self._failed_puts += 1
            n = self._failed_puts
            if should_log(n):
                log.warning(
                    "kv transfer: %s (%d failed puts so far); the decode instance will "
                    "compute the prompt",
                    e,
                    n,
                )
            return False
        return True

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
            _, request_id, ids, params, arrival, images = msg
            try:
                self._core.add_request(request_id, ids, params, arrival, images)
            except Exception as e:  # invalid after all: fail just this request
                out.append((request_id, e))
        elif kind == "abort":
            result = self._core.abort_request(msg[1])
            if result is not None:
                out.append((msg[1], result))
        elif kind == "abort_all":
            for request_id in self._core.abort_all():
                out.append((request_id, EngineShutdownError(msg[1])))
        elif kind == "fatal":
            raise msg[1]
        elif kind == "call":
            _, fn, fut = msg
            try:
                fut.set_result(fn(self._core))
            except Exception as e:
                fut.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                out: list[tuple[str, RequestOutput | BaseException]] = []
                if not self._core.has_unfinished():
                    self._handle(self._inbox.get(), out)  # idle: block until something arrives
                while True:
                    try:
                        self._handle(self._inbox.get_nowait(), out)
                    except queue.Empty:
                        break
                if self._core.has_unfinished():
                    out.extend((o.request_id, o) for o in self._core.step())
                self._post(out)
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            log.critical("engine loop died:\n%s", traceback.format_exc())
            self.dead = e
            err = EngineDeadError(f"engine loop died: {e!r}")
            self._post([(rid, err) for rid in list(self._queues)])
            self._fail_pending_calls(err)
            self._core.abort_all()
            if self.on_death is not None:
                self.on_death(e)

    def _fail_pending_calls(self, err: BaseException) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "call":
                msg[2].set_exception(err)
