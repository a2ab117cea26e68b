"""The engine's host memory (engine/runner/pool_memory.py): a forked child does not turn the KV
pool's first writes into page copies, and freed step buffers stay mapped for the next step.
Measured as the page faults the kernel counts, not as time."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchBackend
from engine.runner.model_runner import allocate_kv_caches

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _faults_writing_beside_a_fork(t: torch.Tensor) -> int:
    """Minor faults while this process writes all of `t` as a forked child lives."""
    pid = os.fork()
    if pid == 0:  # the child only waits (a grammar worker never reads the pool either)
        signal.pause()
        os._exit(0)
    try:
        before = _faults()
        t.fill_(1)
        return _faults() - before
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_forked_child_leaves_the_kv_pool_written_in_place() -> None:
    cpu = torch.device("cpu")
    [pool] = allocate_kv_caches(TorchBackend, [(2, 64)], 64, 64, torch.float32, cpu)
    pages = pool.untyped_storage().nbytes() // 4096
    assert pages >= 1000 and not pool.any()
    inherited = torch.zeros(pool.shape)  # the same allocation, not kept out of forks
    copied = _faults_writing_beside_a_fork(inherited)
    assert copied > pages // 2  # copy-on-write: a fault for each page written
    assert _faults_writing_beside_a_fork(pool) < pages // 20


def test_a_small_pool_beside_mallocs_heap_forks_cleanly() -> None:
    """A pool of a few KiB is its own mapping too, so a forked child that allocates and frees
    through malloc's heap (as the grammar worker does) never walks into an excluded page."""
    cpu = torch.device("cpu")
    [small] = allocate_kv_caches(TorchBackend, [(2, 64)], 2, 16, torch.float32, cpu)
    small.fill_(1)
    pid = os.fork()
    if pid == 0:
        blocks = [bytearray(1 << 16) for _ in range(64)]
        del blocks
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert small.sum() == small.numel()


CYCLES = textwrap.dedent(
    """
    import resource, sys, threading
    import torch
    if sys.argv[1] == "kept":
        from engine.runner.pool_memory import keep_freed_memory
        assert keep_freed_memory()
    sizes = (1 << 20, 3 << 20, 1 << 19)  # float32: 4, 12 and 2 MiB, as a chunk's activations
    out = []
    def steps():  # on a thread, as the engine steps (its own malloc arena)
        [torch.ones(n) for n in sizes]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            [torch.ones(n) for n in sizes]
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    t = threading.Thread(target=steps)
    t.start()
    t.join()
    print(out[0])
    """
)


def test_freed_step_buffers_stay_mapped_for_the_next_step() -> None:
    def faults(mode: str) -> int:
        run = [sys.executable, "-c", CYCLES, mode]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return int(subprocess.run(run, capture_output=True, text=True, env=env, check=True).stdout)

    plain, kept = faults("plain"), faults("kept")
    pages = 20 * (18 << 20) // 4096
    assert plain > pages // 10  # glibc hands the buffers back and faults them in again
    assert kept < plain // 2
