"""CUDA runs of the engine (skipped without a GPU): the torch backend on the device matches the
CPU run, in float32 exactly and in bfloat16 approximately."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.scoring import score_prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[5, 17, 99, 3, 250, 44, 8], list(range(10, 90))]


def test_cuda_matches_cpu(llama_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cpu = LLM(str(llama_dir), num_kv_blocks=64, device="cpu")
    gpu = LLM(str(llama_dir), num_kv_blocks=64, device="cuda", dtype="float32")
    assert gpu.engine.block_size == 16  # the CUDA default
    want = [r.outputs[0].token_ids for r in cpu.generate(PROMPTS, params)]
    assert [r.outputs[0].token_ids for r in gpu.generate(PROMPTS, params)] == want
    for p in PROMPTS:
        a, b = score_prompt(cpu.engine, p), score_prompt(gpu.engine, p).cpu()
        assert (a - b).abs().max() < 1e-3 * a.abs().max()


def test_cuda_bfloat16_close(llama_dir) -> None:
    cpu = LLM(str(llama_dir), num_kv_blocks=64, device="cpu")
    gpu = LLM(str(llama_dir), num_kv_blocks=64, device="cuda")  # auto: bfloat16
    assert gpu.engine.dtype == torch.bfloat16
    for p in PROMPTS:
        a, b = score_prompt(cpu.engine, p), score_prompt(gpu.engine, p).float().cpu()
        assert (a - b).abs().max() < 0.05 * a.abs().max()
    gpu_host = LLM(str(llama_dir), num_kv_blocks=16, device="cuda", host_bytes="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = gpu_host.generate(PROMPTS * 4, params)
    again = gpu_host.generate([PROMPTS[1]], params)[0]
    assert again.outputs[0].token_ids == first[1].outputs[0].token_ids


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory) -> str:
    """A tiny Llama with head_dim 64 (FlashInfer's smallest compiled head size)."""
    from tests.conftest import build_model

    out = tmp_path_factory.mktemp("head64") / "llama"
    dims = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=1)
    return str(build_model("llama", out, **dims))


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("flashinfer"), reason="needs flashinfer"
)
def test_flashinfer_matches_torch_backend(head64_dir) -> None:
    """Chosen automatically on a GPU for a supported geometry; same greedy tokens and close
    logits as the reference backend, with decode-only and mixed prefill steps, GQA 4."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fast = LLM(head64_dir, num_kv_blocks=64, device="cuda", dtype="bfloat16")
    ref = LLM(head64_dir, num_kv_blocks=64, device="cuda", dtype="bfloat16",
              attention_backend="torch")  # fmt: skip
    assert fast.engine.backend_cls.name == "flashinfer" and fast.engine.backend_choice.fast
    want = [r.outputs[0].token_ids for r in ref.generate(PROMPTS * 3, params)]
    got = [r.outputs[0].token_ids for r in fast.generate(PROMPTS * 3, params)]
    agree = sum(a == b for a, b in zip(got, want))
    assert agree >= len(want) - 1  # bf16 kernels may flip a near-tie
    for p in PROMPTS:
        a, b = score_prompt(ref.engine, p).float(), score_prompt(fast.engine, p).float()
        assert (a - b).abs().max() < 0.05 * a.abs().max()
