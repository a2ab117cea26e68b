"""A tensor-parallel rank other than 0: its shard of the weights and of the KV pool, and a loop
that applies what rank 0 sends (engine/parallel/tensor_parallel.py): each step's batch plan, run
through the same `step_inputs` and forward as rank 0's, and each KV copy rank 0 decided. It samples
nothing and keeps no request state.

Start-up, in order with rank 0: "joining" -> meet in the process group -> load the shard ->
receive rank 0's pool decisions (`WorkerBuild`) -> allocate the pool, warm the backend up
alone -> "ready". A failure on the way is reported to rank 0 with its reason.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection

import torch

from engine.attention import BACKENDS
from engine.build.builder import block_prefix_copier
from engine.build.warmup import warm_up
from engine.config import EngineConfig
from engine.kv.host import HostTier
from engine.parallel.shm_allreduce import ShmAllReduce
from engine.parallel.tensor_parallel import WorkerBuild, all_reduce, join_vocab_parts, meet
from engine.runner.model_runner import allocate_kv_caches
from engine.runner.step_inputs import step_inputs
from models.layers import measure_packed_rows, pack_linears
from models.llama import LlamaForCausalLM
from models.loader import default_model_path, load_model
from models.tp_plan import RankShard, TPPlan

log = logging.getLogger("kvserve.engine")


def main() -> None:
    """`python -m engine.parallel.worker CONTROL_PORT RANK`, started by rank 0
    (KVSERVE_TP_KEY in the environment authenticates the connection back to it)."""
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    key = bytes.fromhex(os.environ.pop("KVSERVE_TP_KEY"))
    conn = Client(("127.0.0.1", port), authkey=key)
    conn.send(rank)
    kind, config, plan, gloo_port, device_name, threads, shm = conn.recv()
    assert kind == "setup", kind
    worker_main(config, rank, plan, gloo_port, device_name, threads, shm, conn)


def worker_main(
    config: EngineConfig,
    rank: int,
    plan: TPPlan,
    port: int,
    device_name: str,
    threads: int,
    shm: str | None,
    conn: Connection,
) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank}: %(message)s"
    )
    torch.set_num_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    try:
        conn.send(("joining", None))
        group = meet(rank, plan.world, port, device, float(config.tensor_parallel_timeout_s))
        kind, dtype_name = conn.recv()  # rank 0's dtype choice (a startup measurement)
        assert kind == "load", kind
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        worker = Worker(config, plan, rank, dtype, device)
        reducer = None
        if shm is not None:
            reducer = ShmAllReduce(rank, plan.world, shm)
            parent = os.getppid()
            reducer.lost = lambda: "rank 0 exited" if os.getppid() != parent else None
        kind, build = conn.recv()
        assert kind == "build", kind
        reduce = reducer if reducer is not None else functools.partial(all_reduce, group=group)
        summary = worker.build(build, reduce)
        conn.send(("ready", summary))
    except BaseException as e:  # noqa: BLE001 - rank 0 reports it
        log.error("start-up failed:\n%s", traceback.format_exc())
        try:
            conn.send(("failed", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
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
    def __init__(
        self,
        config: EngineConfig,
        plan: TPPlan,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        from engine.weights.quantization import serve_gguf_blocks
        from models import gguf_linear

        self.config, self.device = config, device
        path = config.model or default_model_path()
        self.model: LlamaForCausalLM
        self.model, full = load_model(path, dtype, device, lambda s: RankShard(s, plan, rank))
        shard = RankShard(full, plan, rank)
        self.spec = shard.spec
        gguf = False
        if config.quantization == "auto":
            _, gguf = serve_gguf_blocks(self.model, path, full, device, shard)
        if config.cpu_packed_weights:
            pack_linears(self.model)
            if device.type == "cpu":
                measure_packed_rows(self.model)
        if gguf:
            gguf_linear.measure_crossover(self.model, dtype, config.gguf_int8_activations)

    def build(self, build: WorkerBuild, reduce: Callable[[torch.Tensor], torch.Tensor]) -> str:
        backend_cls = next(b for b in BACKENDS if b.name == build.backend)
        workspace = backend_cls.allocate_workspace(self.device)
        self.block_size = build.block_size
        self.kv_caches = allocate_kv_caches(
            backend_cls, self.spec.kv_groups, build.num_blocks, build.block_size,
            build.kv_dtype, self.device,
        )  # fmt: skip
        self.backend = backend_cls(self.spec, self.kv_caches, build.block_size, workspace)
        warm_up(self.model, self.backend, self.spec, build.num_blocks, build.block_size,
                self.device)  # fmt: skip
        self.host = None
        if build.host_blocks:
            self.host = HostTier(
                self.kv_caches, backend_cls.block_dim, 0, num_blocks=build.host_blocks
            )
        self.copy_prefix = block_prefix_copier(backend_cls, self.kv_caches)
        self.model.set_reduce(reduce)
        self.reduce = reduce
        kv = sum(c.numel() * c.element_size() for c in self.kv_caches)
        return f"{build.num_blocks} blocks, {kv / 2**20:.1f} MiB of KV"

    @torch.inference_mode()
    def serve(self, conn: Connection) -> None:
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "step":
                _, seqs, token_ids, rows = msg
                ids, positions, meta, index = step_inputs(
                    seqs, self.block_size, self.device, token_ids, rows
                )
                hidden = self.model(ids, positions, self.backend.plan(meta))
                if rows:  # this rank's part of the sampling rows' logits
                    join_vocab_parts(
                        self.model.compute_logits, hidden.index_select(0, index),
                        self.model.vocab_rows, self.model.spec.vocab_size, self.reduce,
                    )  # fmt: skip
            elif kind == "kv_out":
                assert self.host is not None
                self.host.copy_out(msg[1], msg[2])
            elif kind == "kv_in":
                assert self.host is not None
                self.host.copy_in(msg[1], msg[2])
            elif kind == "copy_prefix":
                self.copy_prefix(*msg[1:])
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown message {kind!r}")


if __name__ == "__main__":
    main()
