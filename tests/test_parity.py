"""Numerical parity with `transformers` on tiny random checkpoints of every architecture."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from tests.conftest import ARCHS

PROMPTS = [
    [5, 17, 99, 3, 250, 44, 8],
    list(range(10, 60)),
    [300, 301, 302],
    [7] * 37,
]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_and_greedy_match_transformers(arch: str, model_dirs) -> None:
    path = str(model_dirs[arch])
    ref = hf_model(path)
    llm = LLM(path, num_kv_blocks=128, block_size=16)
    for prompt in PROMPTS:
        ours = score_prompt(llm.engine, prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0].float()
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() < 1e-4 * scale, arch

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = llm.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, results):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert res.outputs[0].token_ids == gen[0, len(prompt) :].tolist(), arch
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory) -> str:
    """Mistral with a 16-token sliding window: prompts below run 3-4 windows past it."""
    from tests.conftest import build_model

    out = tmp_path_factory.mktemp("mistral-window") / "mistral"
    return str(build_model("mistral", out, sliding_window=16))


@pytest.mark.parametrize("block_size,chunk", [(4, 1024), (16, 7), (64, 1024)])
def test_sliding_window_matches_transformers(windowed_mistral, block_size, chunk) -> None:
    ref = hf_model(windowed_mistral)
    llm = LLM(
        windowed_mistral, num_kv_blocks=64, block_size=block_size, max_num_batched_tokens=chunk
    )
    assert llm.engine.spec.sliding_window == 16
    assert llm.engine.kv.window is not None  # its blocks behind the window go back
    prompts = [list(range(10, 70)), [7, 8, 9] * 15]
    for prompt in prompts:
        ours = score_prompt(llm.engine, prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0].float()
        assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, res in zip(prompts, llm.generate(prompts, params)):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert res.outputs[0].token_ids == gen[0, len(prompt) :].tolist()
    assert llm.engine.kv.window.num_reclaimed > 0
    assert llm.engine.kv.window.pool.num_free_blocks == llm.engine.kv.window.pool.num_blocks - 1
