"""Tensor parallelism's processes, seen from rank 0 (the server's engine thread).

Rank 0 starts ranks 1..N-1 itself (each a fresh `python -m engine.parallel.worker` that dials back
on loopback), so no external launcher is needed. Two channels join them:
- a pipe per worker, the control plane: rank 0 sends each step's batch plan (block tables,
  first positions, token ids) and each KV copy it decides (host-tier saves and loads, partial
  block copies), in order; a worker applies them to its own shard of the weights and of the
  KV pool. A worker waits on its pipe while the server idles (no collective timeout to outlive)
  and ends when the pipe closes (rank 0 gone).
- the data plane: the two sums per layer inside a step's forward, through shared memory on CPU
  (engine/parallel/shm_allreduce.py; gloo when asked) and NCCL on CUDA, in a `torch.distributed`
  process group all ranks join.
Scheduling, block tables, prefix hashes, tiers, sampling and speculation stay on rank 0.

A worker that dies is seen at once by a thread waiting on its process, which records why and
calls `on_lost` (the async engine turns it into a fatal error: /health 503, the server exits
non-zero); a step in flight fails in its sum instead of hanging.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.parallel.collectives import all_reduce, free_port, join_vocab_parts, meet
from engine.parallel.messages import (
    CopyPrefix,
    KVCopy,
    Report,
    Setup,
    Stop,
    ToWorker,
    WorkerBuild,
)
from engine.parallel.shm_allreduce import ShmAllReduce
from models.linear.layer import Linear
from models.spec import ModelSpec
from models.tp_plan import RankShard, TPPlan, plan_tensor_parallel

log = logging.getLogger("kvserve.engine")


def threads_per_rank(world: int) -> int:
    """The CPU cores each rank's kernels get: one OpenMP team per rank, never oversubscribed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world)


class TPGroup:
    """Rank 0's handle on the other ranks: start, broadcast, watch, stop."""

    def __init__(self, plan: TPPlan, config: EngineConfig, device: torch.device):
        self.plan = plan
        self.world = plan.world
        self.on_lost: Callable[[BaseException], None] | None = None
        self._closing = threading.Event()  # set before the workers are told to stop
        self._threads_before = torch.get_num_threads()
        threads = threads_per_rank(self.world)
        torch.set_num_threads(threads)
        timeout = float(config.tensor_parallel_timeout_s)
        # Each worker is a fresh interpreter (`python -m engine.parallel.worker`), not a
        # multiprocessing child: nothing of the caller's __main__ is imported again, so the
        # offline API works from any script. It dials back on loopback, authenticated.
        key = secrets.token_bytes(32)
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(0.1)
        root = str(Path(__file__).resolve().parent.parent)
        env = {
            **os.environ,
            "KVSERVE_TP_KEY": key.hex(),
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "engine.parallel.worker",
                    str(server.getsockname()[1]),
                    str(rank),
                ],
                env=env,
            )
            for rank in range(1, self.world)
        ]
        self.conns: list[mpc.Connection] = []
        # the CPU all-reduce: shared memory (parallel/shm_allreduce.py) unless gloo is asked for
        self.reducer: ShmAllReduce | None = None
        if device.type == "cpu" and config.tensor_parallel_allreduce != "gloo":
            self.reducer = ShmAllReduce(0, self.world)
            this = weakref.ref(self)  # the finalizer below holds the reducer: no cycle to self
            self.reducer.lost = lambda: getattr(this(), "lost", "rank 0's engine is gone")
        self.lost: str | None = None  # why a rank is gone, once one is
        self.group: dist.ProcessGroup | None = None
        self._finalizer = weakref.finalize(
            self, _stop, self.procs, self.conns, self._closing, self.reducer
        )
        try:
            self.conns += self._accept(server, key, timeout)
            port = free_port()
            shm = self.reducer.name if self.reducer is not None else None
            self.send(Setup(config, plan, port, str(device), threads, shm))
            self._await("joining", timeout)
            self.group = meet(0, self.world, port, device, timeout)
        except BaseException:
            self.close()
            raise
        finally:
            server.close()
        log.info(
            "tensor parallel: %d ranks (pids %s), %d threads each",
            self.world,
            [os.getpid(), *(p.pid for p in self.procs)],
            threads,
        )

    def _accept(self, server: socket.socket, key: bytes, timeout_s: float) -> list[mpc.Connection]:
        """Each worker's control connection, in rank order."""
        deadline = time.monotonic() + timeout_s
        conns: dict[int, mpc.Connection] = {}
        while len(conns) < self.world - 1:
            self._check_alive("connecting")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel ranks did not connect within {timeout_s:.0f} s "
                    f"({len(conns)} of {self.world - 1})"
                )
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            sock.setblocking(True)
            conn = mpc.Connection(sock.detach())
            try:
                mpc.deliver_challenge(conn, key)
                mpc.answer_challenge(conn, key)
                conns[int(conn.recv())] = conn
            except (mp.AuthenticationError, EOFError, OSError, ValueError):
                conn.close()  # not one of ours
        return [conns[r] for r in range(1, self.world)]

    def _check_alive(self, what: str) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                    f"before {what} (its log is above)"
                )

    @property
    def reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sum over ranks the model's layers call."""
        if self.reducer is not None:
            return self.reducer
        assert self.group is not None
        return functools.partial(all_reduce, group=self.group)

    def shard(self, spec: ModelSpec) -> RankShard:
        return RankShard(spec, self.plan, 0)

    def share_logits(self, lm_head: Linear, vocab_size: int) -> None:
        """From now on `logits` computes rank 0's vocabulary part with views of `lm_head`'s
        rows, the other ranks theirs."""
        self.vocab_part = RankShard.vocab_part_of(vocab_size, self.world, 0)
        self.vocab_size = vocab_size
        self._vocab_head = lm_head.rows(slice(*self.vocab_part))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's sampling rows' logits, computed by vocabulary part on every rank."""
        return join_vocab_parts(
            self._vocab_head, hidden, self.vocab_part, self.vocab_size, self.reduce
        )

    def largest_block_bytes(self, spec: ModelSpec, dtype_size: float, block_size: int) -> int:
        """One KV block's bytes on the worker rank that holds the most KV."""
        return max(
            RankShard(spec, self.plan, r).spec.kv_bytes_per_token(dtype_size) * block_size
            for r in range(1, self.world)
        )

    def mirrored_copier(
        self, copy: Callable[[int, int, int], None]
    ) -> Callable[[int, int, int], None]:
        """The partial-block copy (src, dst, tokens), done on every rank."""

        def copy_everywhere(src: int, dst: int, num_tokens: int) -> None:
            self.send(CopyPrefix(src, dst, num_tokens))
            copy(src, dst, num_tokens)

        return copy_everywhere

    def mirror_kv(self, direction: Literal["out", "in"], a: list[int], b: list[int]) -> None:
        """A host-tier copy rank 0 decided, done by every rank on its own shard."""
        self.send(KVCopy(direction, a, b))

    def _await(self, what: str, timeout_s: float) -> list[str | None]:
        """Each worker's next message, which must be `what`; a worker that reports a failure,
        dies or stays silent past `timeout_s` is a RuntimeError naming it."""
        deadline = time.monotonic() + timeout_s
        replies = []
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.1):
                self._check_alive(what)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} was not {what} within {timeout_s:.0f} s"
                    )
            try:
                report: Report = conn.recv()
            except EOFError:
                code = self.procs[rank - 1].wait(5)
                raise RuntimeError(
                    f"tensor-parallel rank {rank} died (code {code}) before {what}"
                ) from None
            if report.state == "failed":
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {report.detail}")
            assert report.state == what, (report, what)
            replies.append(report.detail)
        return replies

    def start_serving(self, build: WorkerBuild, timeout_s: float) -> list[str | None]:
        """Hand the workers rank 0's pool decisions, wait until each has built and warmed up
        its shard, then watch them. Returns each worker's summary."""
        self.send(build)
        replies = self._await("ready", timeout_s)
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(
                target=_watch,
                args=(weakref.ref(self), rank, proc),
                name=f"kvserve-tp{rank}-watch",
                daemon=True,
            ).start()
        return replies

    def send(self, msg: ToWorker) -> None:
        """One message to every worker, in order with all the others."""
        for conn in self.conns:
            conn.send(msg)

    def _rank_exited(self, rank: int, code: int) -> None:
        if self._closing.is_set():
            return
        self.lost = f"tensor-parallel rank {rank} exited (code {code})"
        error = RuntimeError(self.lost)
        log.critical("%s: the server cannot serve without it", error)
        if self.on_lost is not None:
            self.on_lost(error)

    def close(self) -> None:
        """Stop the workers and drop the process group. Also run, without the thread count's
        restore, when the group is garbage-collected (an engine dropped, not shut down)."""
        if not self._finalizer.alive:
            return
        self._finalizer()
        self.group = None
        torch.set_num_threads(self._threads_before)


def _watch(group: weakref.ref[TPGroup], rank: int, proc: subprocess.Popen) -> None:
    """Wait for a worker's exit and tell its group, if the group is still there (a weak
    reference: a watcher must not keep a dropped engine's ranks alive)."""
    code = proc.wait()
    owner = group()
    if owner is not None:
        owner._rank_exited(rank, code)


def refusal(config: EngineConfig, cuda_devices: Callable[[], int] | None = None) -> str | None:
    """Why these settings cannot run tensor parallel, or None. On CUDA each rank needs a GPU of
    its own (rank r on cuda:(i + r) after --device cuda:i): two ranks on one GPU would fail at
    the first request's all-reduce, after /health said ready."""
    device = config.resolved_device()
    if device.type == "cuda":
        n, first = config.tensor_parallel_size, device.index or 0
        count = (cuda_devices or torch.cuda.device_count)()
        if first + n > count:
            return (
                f"{n} ranks need {n} GPUs from cuda:{first}; this machine has {count} "
                "(each rank runs on a GPU of its own)"
            )
    if config.quantization in ("int8", "int4", "int8wo"):
        return (
            f"--quantization {config.quantization} calibrates or rounds the whole model at "
            "startup, not a rank's shard; serve a GGUF's own blocks (auto) or none"
        )
    if config.disk_path:
        return "the disk KV tier stores whole blocks, not each rank's shard; unset --disk-path"
    return None


def start_ranks(config: EngineConfig) -> TPGroup | None:
    """The other ranks, started and met (None for one rank); ValueError for a model or
    settings that cannot be split."""
    n = config.tensor_parallel_size
    if n == 1:
        return None
    why = refusal(config)
    if why is not None:
        raise ValueError(f"--tensor-parallel-size {n}: {why}")
    from models.loader import default_model_path, load_spec

    plan = plan_tensor_parallel(load_spec(config.model or default_model_path()), n)
    return TPGroup(plan, config, config.resolved_device())


def _stop(
    procs: list[subprocess.Popen],
    conns: list[mpc.Connection],
    closing: threading.Event,
    reducer: ShmAllReduce | None,
) -> None:
    closing.set()
    for conn in conns:
        try:
            conn.send(Stop())
        except (OSError, ValueError):
            pass  # already gone
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for conn in conns:
        conn.close()
    if reducer is not None:
        reducer.close(unlink=True)
