"""How the tensor-parallel ranks meet and sum: the process group they join on loopback (a
TCP store, then gloo on CPU or NCCL on CUDA), the all-reduce of a partial layer output through
it, and the logits joined from each rank's vocabulary part. Rank 0 (tensor_parallel.py) and
every worker (worker.py) use the same functions, so both sides agree by construction."""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective waits at most this long for the other ranks (they are all inside the same step,
# so this bounds one layer's compute, not an idle server).
COLLECTIVE_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def meet(
    rank: int, world: int, port: int, device: torch.device, timeout_s: float
) -> dist.ProcessGroup:
    """The ranks' process group, met on loopback; RuntimeError if they do not all arrive
    within `timeout_s`. A group of this engine's own, not torch's default group: engines built
    one after another, or side by side, in one process each have theirs, and a group ends with
    its owner (no global state to tear down)."""
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s)
        )
        store.set(f"rank{rank}", "here")
        store.wait([f"rank{r}" for r in range(world)])
    except Exception as e:  # noqa: BLE001 - the store's timeout, in its own words
        raise RuntimeError(
            f"tensor-parallel ranks did not meet within {timeout_s:.0f} s "
            f"(rank {rank} of {world}, port {port}): {str(e).splitlines()[0]}"
        ) from None
    store = dist.PrefixStore("kvserve-tp", store)
    if device.type == "cuda":  # (unrun here: no GPU in this project's CI)
        group: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, world)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    # one collective now: NCCL makes its communicator at the first one, so a broken one (two
    # ranks on one GPU, a missing peer link) fails here, before the server reports ready
    probe = torch.ones(1, device=device)
    group.allreduce([probe]).wait()
    if int(probe.item()) != world:
        raise RuntimeError(
            f"tensor-parallel ranks' first all-reduce summed {probe.item()}, not {world}"
        )
    return group


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of a partial layer output over the ranks, by torch.distributed (NCCL on CUDA;
    gloo on CPU when asked, where shared memory is the default). A contiguous input is summed
    in place (the CPU linear returns transposed views; gloo reads raw memory)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        total = x.float()  # gloo sums float32 (and rounding once after the sum is closer)
        group.allreduce([total]).wait()
        return total.to(x.dtype)
    x = x.contiguous()
    group.allreduce([x]).wait()
    return x


def join_vocab_parts(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    part: tuple[int, int],
    vocab_size: int,
    reduce: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Float32 logits [rows, vocab] from each rank's vocabulary part: this rank's part in place,
    zeros elsewhere, summed over the ranks (every rank runs this on the same rows)."""
    logits = hidden.new_zeros((hidden.shape[0], vocab_size), dtype=torch.float32)
    logits[:, part[0] : part[1]] = head(hidden).float()
    return reduce(logits)
