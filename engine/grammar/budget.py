"""Grammar compiles within a time budget, at most a few at once.

xgrammar cannot interrupt a compile, and a compiled grammar does not travel between processes
at a usable cost (its JSON form is ~100x its memory: 227 MB and 22 s to write for a
1,000-property schema that compiles in 0.1 s). So a grammar the server has not compiled before
is first compiled by a trial in a worker process (forked from the server: the tokenizer tables
come with it; at the lowest nice, so the engine keeps its cores); a trial that outlives the
budget is killed and the request answered with a 400 naming the limit, and the spec is
remembered as over budget.
A trial that finishes is followed by the real compile in the server process, which then takes
about as long (compiles are deterministic). The worker slot is held until that compile ends, so
at most `workers` grammars compile at any time; requests beyond them wait, at most
`max_waiting` of them (then 503), each no longer than its own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.core.sampling_params import GrammarSpec, ParamError

if TYPE_CHECKING:
    from engine.grammar.structured_output import StructuredOutputs

log = logging.getLogger("kvserve.structured")

REMEMBERED = 1024  # specs known to compile in budget / to exceed it


class GrammarBusyError(RuntimeError):
    """Too many grammars wait to compile (an HTTP 503)."""


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _yield_to_serving() -> None:
    """The lowest nice: at nice 10 a trial still took enough of a two-core machine from the
    engine's threads to make a plain request 2-3x slower while it ran. Not SCHED_IDLE: a trial
    starved by steady serving would miss its budget and get a grammar refused that compiles."""
    os.nice(19 - os.nice(0))


def _serve_trials(conn: Connection, structured: StructuredOutputs) -> None:
    """A worker: compile each spec it is sent with a private compiler; answer the error or None."""
    _die_with_parent()
    _yield_to_serving()
    compiler = structured.xgr.GrammarCompiler(structured.info, max_threads=1, cache_enabled=False)
    while True:
        try:
            spec, param = conn.recv()
        except EOFError:
            return
        try:
            structured.compile_with(compiler, spec, param)
            conn.send(None)
        except ParamError as e:
            conn.send(str(e))


class _Worker:
    def __init__(self, structured: StructuredOutputs) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve_trials, args=(child, structured), name="kvserve-grammar", daemon=True
        )
        self.process.start()
        child.close()

    def trial(self, spec: GrammarSpec, param: str, budget_s: float) -> tuple[bool, str | None]:
        """(finished within the budget, the compile error if any)."""
        self.conn.send((spec, param))
        if not self.conn.poll(budget_s):
            return False, None
        return True, self.conn.recv()

    def stop(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class GrammarBudget:
    """The server's door to the grammar compiler (thread-safe `StructuredOutputs.compile`
    behind a budget). Owned by the AsyncEngine; `close()` stops the workers by PID."""

    def __init__(
        self,
        structured: StructuredOutputs,
        budget_s: float,
        workers: int,
        max_waiting: int = 32,
    ) -> None:
        self.structured = structured
        self.budget_s = budget_s
        self.max_waiting = max_waiting
        self._workers = [_Worker(structured) for _ in range(workers)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self.waiting = 0
        self._verdicts: OrderedDict[GrammarSpec, str | None] = OrderedDict()  # None: compiles
        self.over_budget = 0  # trials killed at the budget

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def _remember(self, spec: GrammarSpec, verdict: str | None) -> None:
        self._verdicts[spec] = verdict
        self._verdicts.move_to_end(spec)
        while len(self._verdicts) > REMEMBERED:
            self._verdicts.popitem(last=False)

    async def compile(self, spec: GrammarSpec, param: str, timeout_s: float | None) -> None:
        """Compile `spec` (into the server's cache) or raise ParamError naming `param` (it
        cannot compile, or not within the budget), GrammarBusyError, or TimeoutError (it
        waited longer than `timeout_s` for a worker)."""
        if spec in self._verdicts:
            verdict = self._verdicts[spec]
            self._verdicts.move_to_end(spec)
            if verdict is not None:
                raise ParamError(param, verdict)
            await asyncio.to_thread(self.structured.compile, spec, param)  # a cache hit
            return
        if self._idle is None:
            self._idle = asyncio.Queue()
            for w in self._workers:
                self._idle.put_nowait(w)
        if self.waiting >= self.max_waiting:
            raise GrammarBusyError(f"{self.waiting} grammars are waiting to compile")
        self.waiting += 1
        try:
            worker = await asyncio.wait_for(self._idle.get(), timeout_s)
        finally:
            self.waiting -= 1
        error = "the grammar compiler stopped"
        try:
            worker, error = await asyncio.to_thread(self._compile_on, worker, spec, param)
        finally:
            self._idle.put_nowait(worker)
        if error is not None:
            raise ParamError(param, error)

    def _compile_on(
        self, worker: _Worker, spec: GrammarSpec, param: str
    ) -> tuple[_Worker, str | None]:
        """The trial, then the real compile: the worker to give back (a new one if the trial
        was killed) and the error, if any."""
        t0 = time.perf_counter()
        finished, error = worker.trial(spec, param, self.budget_s)
        if not finished:
            worker.stop()
            self.over_budget += 1
            log.warning(
                "a %s grammar did not compile within %.3g s; its worker was killed",
                spec.kind,
                self.budget_s,
            )
            message = (
                f"{param}: this {spec.kind} does not compile within the server's budget "
                f"(--max-grammar-compile-s {self.budget_s:g}); simplify it (fewer optional "
                "properties, alternatives or repetitions)"
            )
            self._remember(spec, message)
            self._workers.remove(worker)
            worker = _Worker(self.structured)
            self._workers.append(worker)
            return worker, message
        if error is not None:
            self._remember(spec, error)
            return worker, error
        self.structured.compile(spec, param)
        self._remember(spec, None)
        log.debug(
            "%s grammar compiled in %.3f s (trial and compile)", spec.kind, time.perf_counter() - t0
        )
        return worker, None

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers.clear()


def default_workers() -> int:
    """One fewer than the cores this process may use (at least one)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)
