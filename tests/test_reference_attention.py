"""The reference attention backend (engine/attention/reference_backend.py: each sequence's pages
gathered, then `scaled_dot_product_attention`), forced by `attention_backend = "reference"`,
serving a tiny Mistral with a sliding window of 6 and four query heads per KV head through the
engine: prompt logits against `transformers` on the same weights (prefill in chunks of 7 across
the window and the blocks of 4), greedy decode against transformers' and against the CPU backend
(the production one), token for token; an int8 KV cache served; and what it refuses, with the
reason, in the kernel matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import select_backend
from engine.attention.matrix import DeviceFacts, ModelNeeds
from engine.attention.reference_backend import ReferenceBackend
from engine.core.scoring import score_prompt
from models.spec import ModelSpec, uniform_layers
from tests.conftest import build_model

PROMPTS = [list(range(3, 25)), [7, 8, 9, 10] * 4 + [11]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
ENGINE = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=7, num_speculative_tokens=0)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "m"
    # head_dim 32: int8 KV rows hold a scale per 32 values
    return build_model("mistral", out, sliding_window=6, head_dim=32)


@pytest.fixture(scope="module")
def hf(windowed: Path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32).eval()
    assert ref.config.sliding_window == 6 and ref.config.num_key_value_heads == 1
    return ref


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def served(llm: LLM) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs per prompt."""
    outs = llm.generate(PROMPTS, GREEDY)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def test_reference_backend_matches_transformers_and_the_cpu_backend(windowed: Path, hf) -> None:
    results = {}
    for backend in ("reference", "torch"):
        llm = LLM(str(windowed), attention_backend=backend, **ENGINE)
        assert llm.engine.info.attention_backend == backend
        for prompt in PROMPTS:
            ours, theirs = score_prompt(llm.engine, prompt), hf_logits(hf, prompt)
            assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
        results[backend] = served(llm)
        assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks
    for prompt, (tokens, _) in zip(PROMPTS, results["reference"]):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert tokens == gen[0, len(prompt) :].tolist()
    for (tokens, logprobs), (cpu_tokens, cpu_logprobs) in zip(
        results["reference"], results["torch"]
    ):
        assert tokens == cpu_tokens
        assert logprobs == pytest.approx(cpu_logprobs, abs=1e-4)


def test_reference_backend_serves_an_int8_kv_cache(windowed: Path, hf) -> None:
    """int8 rows with their scales (engine/attention/kv_quant.py, as the CPU backend writes
    them): transformers' logits within int8's rounding, and the pool whole after serving."""
    llm = LLM(str(windowed), attention_backend="reference", kv_cache_dtype="int8", **ENGINE)
    assert llm.engine.info.attention_backend == "reference"
    for prompt in PROMPTS:
        ours, theirs = score_prompt(llm.engine, prompt), hf_logits(hf, prompt)
        assert (ours - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()
    assert all(len(tokens) == 10 for tokens, _ in served(llm))
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def test_reference_backend_refuses_soft_capping_and_is_never_the_auto_choice() -> None:
    spec = ModelSpec("LlamaForCausalLM", 100, 64, uniform_layers(2, 4, 2, 16, 32))
    capped = ModelSpec(
        "Gemma2ForCausalLM",
        100,
        64,
        uniform_layers(2, 4, 2, 16, 32),
        extra={"attn_logit_softcapping": 50.0},
    )
    cpu, gpu = DeviceFacts("cpu", native_bf16=True), DeviceFacts("cuda", "gpu", (8, 0), True)
    for facts in (cpu, gpu):  # any device, dtype and block size
        for dtype in (torch.float32, torch.bfloat16):
            verdict = ReferenceBackend.check(ModelNeeds.of(spec), facts, dtype, 16)
            assert not any(verdict.values())
    # bf16 on a CPU without native bf16: refused as the CPU backend refuses it, so `auto` does
    # not fall through to the reference there
    slow = DeviceFacts("cpu", bf16_speedup=0.1)
    assert "dtype" in ReferenceBackend.check(ModelNeeds.of(spec), slow, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="no attention backend"):
        select_backend(spec, slow, torch.bfloat16, 64)
    verdict = ReferenceBackend.check(ModelNeeds.of(capped), cpu, torch.float32, 16)
    assert "soft-capping" in (verdict.get("soft-capping") or "")
    with pytest.raises(ValueError, match="soft-capping"):
        select_backend(capped, cpu, torch.float32, 16, forced="reference")
    assert select_backend(spec, cpu, torch.float32, 64).backend.name == "torch"
    forced = select_backend(spec, cpu, torch.float32, 64, forced="reference")
    assert forced.backend is ReferenceBackend and not forced.fast
    with pytest.raises(ValueError, match="slow general path"):
        select_backend(spec, cpu, torch.float32, 64, forced="reference", require_fast_kernels=True)
