"""The kernel-support matrix: selection rules under injected device facts (no GPU needed), the
refusals with reasons, and the `python -m server kernels` command."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from engine.attention import DeviceFacts, select_backend
from models.spec import ModelSpec, uniform_layers
from tests.server_utils import ROOT

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

CPU = DeviceFacts("cpu", "cpu", None, native_bf16=False)
SM80 = DeviceFacts("cuda", "A100", (8, 0), True, frozenset({"flashinfer"}))
SM90 = DeviceFacts("cuda", "H100", (9, 0), True, frozenset({"flashinfer"}))
SM70 = DeviceFacts("cuda", "V100", (7, 0), False, frozenset({"flashinfer"}))


def spec(head_dim: int = 64, heads: int = 8, kv_heads: int = 2, **kw) -> ModelSpec:
    return ModelSpec(
        "LlamaForCausalLM",
        512,
        heads * head_dim,
        uniform_layers(2, heads, kv_heads, head_dim, 128),
        **kw,
    )


def test_cpu_picks_torch_and_says_why() -> None:
    choice = select_backend(spec(), CPU, torch.float32, 64)
    assert choice.backend.name == "torch" and choice.fast
    assert "flashinfer passed over" in choice.reason
    assert "needs a CUDA GPU" in choice.table and "float32: kernels are built for" in choice.table


def test_cpu_refuses_forced_flashinfer_with_reasons() -> None:
    with pytest.raises(ValueError, match="cannot serve this model.*needs a CUDA GPU"):
        select_backend(spec(), CPU, torch.float32, 64, forced="flashinfer")


def test_cpu_refuses_slow_bf16_unless_allowed() -> None:
    with pytest.raises(ValueError, match="bfloat16 on a CPU without native"):
        select_backend(spec(), CPU, torch.bfloat16, 64)
    assert select_backend(spec(), CPU, torch.bfloat16, 64, allow_slow_dtype=True).fast
    native = replace(CPU, native_bf16=True)
    assert select_backend(spec(), native, torch.bfloat16, 64).backend.name == "torch"


@pytest.mark.parametrize("facts", [SM80, SM90], ids=["sm80", "sm90"])
def test_gpu_picks_flashinfer_for_supported_geometry(facts) -> None:
    for head_dim in (64, 128, 256):
        choice = select_backend(spec(head_dim), facts, torch.bfloat16, 16)
        assert choice.backend.name == "flashinfer" and choice.fast


@pytest.mark.parametrize(
    "model,dtype,block,facts,why",
    [
        (spec(96), torch.bfloat16, 16, SM90, "head_dim [96]"),
        (spec(), torch.float32, 16, SM90, "float32: kernels are built"),
        (spec(), torch.bfloat16, 128, SM80, "page size 128"),
        (spec(), torch.bfloat16, 16, SM70, "bfloat16 needs sm80+"),
        (spec(), torch.bfloat16, 16, replace(SM90, libraries=frozenset()), "not installed"),
    ],
    ids=["head_dim", "fp32", "page", "sm70-bf16", "no-lib"],
)
def test_gpu_falls_to_slow_torch_loudly(model, dtype, block, facts, why, caplog) -> None:
    choice = select_backend(model, facts, dtype, block)
    assert choice.backend.name == "torch" and not choice.fast
    assert why in choice.table
    assert "slow general path" in caplog.text
    with pytest.raises(ValueError, match="require-fast-kernels"):
        select_backend(model, facts, dtype, block, require_fast_kernels=True)
    with pytest.raises(ValueError, match=why.split(":")[0].replace("[", r"\[")):
        select_backend(model, facts, dtype, block, forced="flashinfer")


def test_per_layer_and_shared_kv_geometry_is_in_the_matrix() -> None:
    layers = uniform_layers(2, 8, 2, 64, 128)
    mixed = (layers[0], replace(layers[1], num_heads=4, num_kv_heads=1))
    shared = (layers[0], replace(layers[1], kv_group=0))
    for geometry in (mixed, shared):
        model = ModelSpec("LlamaForCausalLM", 512, 512, geometry)
        assert model.has_per_layer_heads or model.has_kv_sharing
        choice = select_backend(model, SM90, torch.bfloat16, 16)
        assert choice.backend.name == "flashinfer"  # one plan per distinct geometry


def test_mixed_windows_go_where_a_window_is_per_layer() -> None:
    """Gemma 3's windowed and global layers: FlashInfer plans one window a step, so it is
    refused with the reason and the torch backend (a mask or op argument per layer) serves;
    one window on every layer (Mistral) stays FlashInfer's."""
    gemma = spec(256, sliding_window=512, full_attention_layers=(1,))
    choice = select_backend(gemma, SM90, torch.bfloat16, 16)
    assert choice.backend.name == "torch"
    assert "mixed windows" in choice.table and "not one per layer" in choice.table
    mistral = spec(128, sliding_window=4096)
    assert select_backend(mistral, SM90, torch.bfloat16, 16).backend.name == "flashinfer"


@pytest.mark.slow
def test_kernels_command(llama_dir) -> None:
    run = [sys.executable, "-m", "server", "kernels", "--model", str(llama_dir)]
    ok = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "flashinfer" in ok.stdout and "-> torch" in ok.stdout
    forced = subprocess.run(
        [*run, "--attention-backend", "flashinfer"], cwd=ROOT, capture_output=True, text=True
    )
    assert forced.returncode == 1 and "needs a CUDA GPU" in forced.stdout
