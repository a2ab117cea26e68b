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
