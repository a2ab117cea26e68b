"""GPU round 3's single-GPU facts, caught on a CPU-only machine with the GPU faked: tensor
parallelism refuses more ranks than GPUs at startup and its ranks meet with a collective, the
host tier pins exactly the bytes it asked for in one allocation, and --device cuda:N makes the
engine thread's current device N."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.build.builder import use_device
from engine.config import EngineConfig
from engine.kv.host import host_storage
from engine.parallel.collectives import meet
from engine.parallel.tensor_parallel import refusal


@pytest.mark.parametrize(
    ("device", "ranks", "gpus", "refused"),
    [
        ("cuda", 2, 1, True),
        ("cuda", 2, 2, False),
        ("cuda:1", 2, 2, True),
        ("cuda:1", 2, 3, False),
        ("cpu", 2, 0, False),
    ],
)
def test_tensor_parallel_needs_a_gpu_per_rank(device, ranks, gpus, refused) -> None:
    config = EngineConfig(device=device, tensor_parallel_size=ranks)
    why = refusal(config, cuda_devices=lambda: gpus)
    assert (why is not None) == refused
    if refused:
        assert f"{ranks} ranks need {ranks} GPUs" in why and f"has {gpus}" in why


def test_ranks_meet_with_a_collective(monkeypatch) -> None:
    """Both ranks' first all-reduce runs inside `meet` (NCCL builds its communicator at the
    first collective: a broken one must fail before the server is ready)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls: list[str] = []

    class Counting(torch.distributed.ProcessGroupGloo):
        def allreduce(self, *args, **kwargs):  # type: ignore[override]
            calls.append("allreduce")
            return super().allreduce(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "ProcessGroupGloo", Counting)
    groups: list[object] = [None, None]
    threads = [
        threading.Thread(
            target=lambda r=r: groups.__setitem__(r, meet(r, 2, port, torch.device("cpu"), 30.0))
        )
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups)
    assert calls == ["allreduce", "allreduce"]


def test_host_tier_storage_is_one_allocation_of_exactly_its_bytes() -> None:
    pinned: list[int] = []
    shapes = [(100, 2, 3, 64, 5), (100, 7, 3)]
    dtypes = [torch.bfloat16, torch.float32]
    views, total = host_storage(shapes, dtypes, True, pin_memory=lambda b: pinned.append(b.numel()))
    want = [100 * 2 * 3 * 64 * 5 * 2, 100 * 7 * 3 * 4]
    assert total == want[0] + -(-want[1] // 64) * 64  # each group's start aligned to 64
    assert pinned == [total]  # registered once, exactly (no power-of-two rounding)
    assert [tuple(v.shape) for v in views] == shapes and [v.dtype for v in views] == dtypes
    base = views[0].untyped_storage().data_ptr()
    assert views[1].untyped_storage().data_ptr() == base  # views of the one allocation
    views[1].fill_(1.0)
    assert views[0].abs().sum() == 0  # and they do not overlap
    _, unpinned = host_storage(shapes, dtypes, False, pin_memory=lambda b: pinned.append(0))
    assert unpinned == total and pinned == [total]


def test_cuda_n_becomes_the_threads_current_device(monkeypatch) -> None:
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    use_device(torch.device("cuda", 1))
    use_device(torch.device("cpu"))
    use_device(torch.device("cuda"))  # no index: whatever is current already
    assert chosen == [torch.device("cuda", 1)]
