"""A tensor-parallel rank other than 0: its shard of the weights and of the KV pool, and a loop
that applies what rank 0 sends (engine/parallel/tensor_parallel.py): each step's batch plan, run
through the same `step_inputs` and forward as rank 0's, and each KV copy rank 0 decided. It
samples nothing and keeps no request state.

Start-up, in order with rank 0: "joining" -> meet in the process group -> load the shard
(engine/build/weights.py, the phase rank 0 runs) -> receive rank 0's pool decisions
(`WorkerBuild`) -> allocate the pool and warm the backend up (engine/build/pool.py) -> "ready".
A failure on the way is reported to rank 0 with its reason.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
from typing import TypeVar

import torch

from engine.attention import BACKENDS
from engine.build.pool import block_prefix_copier, pool_for
from engine.build.weights import load_weights
from engine.kv.host import HostTier
from engine.parallel.collectives import all_reduce, join_vocab_parts, meet
from engine.parallel.messages import (
    CopyPrefix,
    KVCopy,
    Load,
    Report,
    Setup,
    Step,
    Stop,
    ToWorker,
    WorkerBuild,
)
from engine.parallel.shm_allreduce import ShmAllReduce
from engine.runner.step_inputs import step_inputs
from models.llama import LlamaForCausalLM
from models.loader import default_model_path
from models.spec import ModelSpec
from models.tp_plan import RankShard

log = logging.getLogger("kvserve.engine")
T = TypeVar("T")


def main() -> None:
    """`python -m engine.parallel.worker CONTROL_PORT RANK`, started by rank 0
    (KVSERVE_TP_KEY in the environment authenticates the connection back to it)."""
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    key = bytes.fromhex(os.environ.pop("KVSERVE_TP_KEY"))
    conn = Client(("127.0.0.1", port), authkey=key)
    conn.send(rank)
    setup = conn.recv()
    assert isinstance(setup, Setup), setup
    worker_main(setup, rank, conn)


def _expect(conn: Connection, kind: type[T]) -> T:
    msg = conn.recv()
    if not isinstance(msg, kind):
        raise RuntimeError(f"expected {kind.__name__} from rank 0, got {msg!r}")
    return msg


def worker_main(setup: Setup, rank: int, conn: Connection) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank}: %(message)s"
    )
    torch.set_num_threads(setup.threads)
    device = torch.device(setup.device)
    if device.type == "cuda":  # rank 0 on --device cuda:i, rank r on cuda:(i + r) (refusal)
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    config, plan = setup.config, setup.plan
    reducer = None
    try:
        conn.send(Report("joining"))
        group = meet(rank, plan.world, setup.port, device, float(config.tensor_parallel_timeout_s))
        load = _expect(conn, Load)
        dtype = getattr(torch, load.dtype.removeprefix("torch."))
        path = config.model or default_model_path()
        weights = load_weights(config, path, dtype, device, lambda s: RankShard(s, plan, rank))
        if setup.shm is not None:
            reducer = ShmAllReduce(rank, plan.world, setup.shm)
            parent = os.getppid()
            reducer.lost = lambda: "rank 0 exited" if os.getppid() != parent else None
        reduce = reducer if reducer is not None else functools.partial(all_reduce, group=group)
        worker = Worker(weights.model, weights.local, _expect(conn, WorkerBuild), reduce, device)
        conn.send(Report("ready", worker.summary()))
    except BaseException as e:  # noqa: BLE001 - rank 0 reports it
        log.error("start-up failed:\n%s", traceback.format_exc())
        try:
            conn.send(Report("failed", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    try:
        worker.serve(conn)
    except EOFError:
        pass  # rank 0 is gone: nothing left to serve
    finally:
        if reducer is not None:
            reducer.close(unlink=False)


class Worker:
    """A rank's shard over a pool of the blocks rank 0 sized, built whole."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        spec: ModelSpec,  # this rank's part
        build: WorkerBuild,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
    ) -> None:
        backend_cls = next(b for b in BACKENDS if b.name == build.backend)
        self.model, self.device, self.build = model, device, build
        self.backend = pool_for(
            model, backend_cls, spec, build.num_blocks, build.block_size, build.kv_dtype, device
        )
        caches = self.backend.kv_caches
        self.host = None
        if build.host_blocks:
            self.host = HostTier(caches, backend_cls.block_dim, 0, num_blocks=build.host_blocks)
        self.copy_prefix = block_prefix_copier(backend_cls, caches)
        model.set_reduce(reduce)
        self.reduce = reduce

    def summary(self) -> str:
        kv = sum(c.numel() * c.element_size() for c in self.backend.kv_caches)
        return f"{self.build.num_blocks} blocks, {kv / 2**20:.1f} MiB of KV"

    @torch.inference_mode()
    def serve(self, conn: Connection) -> None:
        while True:
            msg: ToWorker = conn.recv()
            match msg:
                case Step(seqs, token_ids, rows):
                    self.step(seqs, token_ids, rows)
                case KVCopy("out", blocks, slots):
                    assert self.host is not None
                    self.host.copy_out(blocks, slots)
                case KVCopy("in", slots, blocks):
                    assert self.host is not None
                    self.host.copy_in(slots, blocks)
                case CopyPrefix(src, dst, n):
                    self.copy_prefix(src, dst, n)
                case Stop():
                    return
                case _:
                    raise ValueError(f"unexpected message {msg!r}")

    def step(
        self, seqs: list[tuple[list[int], int, int]], token_ids: list[int], rows: list[int]
    ) -> None:
        ids, positions, meta, index = step_inputs(
            seqs, self.build.block_size, self.device, token_ids, rows
        )
        hidden = self.model(ids, positions, self.backend.plan(meta))
        if rows:  # this rank's part of the sampling rows' logits
            join_vocab_parts(
                self.model.compute_logits,
                hidden.index_select(0, index),
                self.model.vocab_rows,
                self.model.spec.vocab_size,
                self.reduce,
            )


if __name__ == "__main__":
    main()
