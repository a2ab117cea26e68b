"""GPU startup on CPU, with the GPU faked where needed: a failed warm-up frees its
pool before the next is sized, a pool that cannot hold one sequence is refused with its numbers,
an unwritable FlashInfer cache is a startup reason, host-tier copies are awaited on the KV
device's stream, the CUDA block size follows the backend that can serve, and a quantization
that cannot run on the device is refused before the weights load."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

import engine.build.builder as builder
import engine.build.pool as kv_phase
import engine.build.weights as weights_phase
from engine.attention import DeviceFacts
from engine.config import EngineConfig
from engine.kv.host import HostTier
from models.spec import ModelSpec
from tests.test_kernel_contracts import SM90, uniform_layers

# ---- item 1: a failed warm-up, the pool after it, and FlashInfer's cache directory --------------


def test_a_failed_warm_up_frees_its_pool_before_device_memory_is_released(
    llama_dir, monkeypatch
) -> None:
    from engine.attention import select_backend

    pools: list[list[weakref.ref]] = []
    alive_at_release: list[int] = []
    real_allocate, real_warm_up = kv_phase.allocate_kv_caches, kv_phase.warm_up

    def allocate(*args, **kwargs):
        caches = real_allocate(*args, **kwargs)
        pools.append([weakref.ref(c) for c in caches])
        return caches

    def warm_up(model, backend, *args):
        if len(pools) == 1:  # the first backend's kernels fail, as a JIT failure would
            backend.kv_caches[0].zero_()
            raise RuntimeError("simulated JIT failure")
        return real_warm_up(model, backend, *args)

    def release(device) -> None:
        gc.collect()
        alive_at_release.append(sum(r() is not None for r in pools[0]))

    def any_backend(*args, **kwargs):  # the CPU has one backend: let it be tried twice
        kwargs.pop("failed", None)
        return select_backend(*args[:7], **kwargs)

    monkeypatch.setattr(kv_phase, "allocate_kv_caches", allocate)
    monkeypatch.setattr(kv_phase, "warm_up", warm_up)
    monkeypatch.setattr(kv_phase, "release_device_memory", release)
    monkeypatch.setattr(kv_phase, "select_backend", any_backend)
    from engine import LLM

    llm = LLM(str(llama_dir), num_kv_blocks=16, num_speculative_tokens=0)
    assert len(pools) == 2 and alive_at_release == [0]
    assert llm.generate([[1, 2, 3]])[0].outputs[0].token_ids


def test_a_cuda_pool_that_cannot_hold_one_sequence_is_refused(monkeypatch) -> None:
    """The failed pool's memory still counted as used gave max(1, ~0) = one block: a server
    that came up and could not hold a conversation."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(0.95 * gib), 80 * gib))
    config = EngineConfig(gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match=r"less than one 4096-token sequence: 0.95 of 80.00 GiB"):
        kv_phase.num_blocks_for(config, torch.device("cuda"), 2**20, 4096, 16)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    assert kv_phase.num_blocks_for(config, torch.device("cuda"), 2**20, 4096, 16) > 256


def test_an_unwritable_flashinfer_cache_is_a_startup_reason(monkeypatch, tmp_path) -> None:
    from engine.attention import matrix

    monkeypatch.setattr(
        matrix, "_version", lambda name: "0.7.2.post1" if "python" in name else None
    )
    monkeypatch.setattr(matrix, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "cache"))
    assert matrix.kernel_note("flashinfer") is None  # creatable
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(blocker))
    note = matrix.kernel_note("flashinfer")
    assert note is not None and "cannot write" in note and "FLASHINFER_WORKSPACE_BASE" in note
    facts = replace(SM90, libraries=frozenset({"flashinfer"}), kernel_notes={"flashinfer": note})
    spec = ModelSpec("LlamaForCausalLM", 128, 256, uniform_layers(2, 8, 2, 64, 128))
    from engine.attention import select_backend

    choice = select_backend(spec, facts, torch.bfloat16, 16)
    assert choice.backend.name != "flashinfer" and "cannot write" in choice.table


# ---- item 4: host-tier copies are awaited on the KV device's stream ----------------------------


def test_host_tier_records_its_copies_on_the_kv_devices_stream(monkeypatch) -> None:
    recorded: list[object] = []

    class Event:
        def record(self, stream=None) -> None:
            recorded.append(stream)

        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    tier = HostTier([torch.zeros(2, 4, 16, 2, 8)], 2, 1 << 20)
    tier._async, tier.kv_device = True, torch.device("cuda", 1)  # as on --device cuda:1
    tier.save([(b"a", 0)])
    assert recorded == ["stream of cuda:1"]


# ---- item 5: the CUDA block size follows the backend that can serve ----------------------------


def test_cuda_pages_of_64_where_only_xformers_serves_fast(monkeypatch) -> None:
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: torch.device("cuda"))
    spec = ModelSpec("LlamaForCausalLM", 128, 256, uniform_layers(2, 8, 2, 64, 128))
    xformers_only = replace(SM90, libraries=frozenset({"xformers"}))
    cuda = torch.device("cuda")
    size = kv_phase.block_size_for(EngineConfig(), spec, xformers_only, torch.bfloat16, cuda)
    assert size == 64
    assert kv_phase.block_size_for(EngineConfig(), spec, SM90, torch.bfloat16, cuda) == 16
    forced = EngineConfig(block_size=16)
    assert kv_phase.block_size_for(forced, spec, xformers_only, torch.bfloat16, cuda) == 16


# ---- item 6: a quantization the device cannot run is refused before loading --------------------


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_on_cuda_is_refused_before_the_weights_load(
    llama_dir, monkeypatch, quantization
) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    cpu_facts = DeviceFacts.detect(torch.device("cpu"))
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: torch.device("cuda"))
    monkeypatch.setattr(DeviceFacts, "detect", staticmethod(lambda device: cpu_facts))
    monkeypatch.setattr(weights_phase, "load_model", no_load)
    config = EngineConfig(model=str(llama_dir), quantization=quantization, dtype="float32")
    with pytest.raises(ValueError, match=f"--quantization {quantization}"):
        builder.build_engine(config)
