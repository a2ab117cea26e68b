"""Gemma 4's text decoder (issue #68) through the engine against transformers 5.24 on the same
tiny random weights: float32 logits and greedy text (prefill whole and chunked, decode), a
prefix hit, preemption to the host tier, speculation; the shared layers' KV stored once.

Three shapes: (a) KV shared by the last two layers (one sliding, one global, each reading the
last earlier layer of its type), sliding and global layers of different head_dim, per-layer
inputs, soft-capped logits; (b) `attention_k_eq_v` (global layers' values from the key
projection, with their own KV head count); (c) experts beside the dense MLP, double-wide MLP on
the shared layers, no per-layer inputs. And (a)'s weights inside a
`Gemma4ForConditionalGeneration` (its language model served)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from tests.conftest import F, S, build_dirs, save_model
from tests.conftest import randomize as randomize_weights
from tests.gemma4_vl_model import GEMMA4_TEXT, multiplies_by_weight
from tests.test_model_coverage import (
    PROMPTS,
    assert_matches,
    assert_prefix_hit_swap_and_drafts,
    reference,
    whole_and_chunked,
)

BASE = GEMMA4_TEXT | dict(
    num_hidden_layers=4, layer_types=[S, F, S, F], hidden_size_per_layer_input=0
)
# (a): layers 3 (sliding) and 4 (global) read the last earlier layer of their type: 1 and 2
CONFIGS = {
    "shared": dict(
        num_hidden_layers=5,
        layer_types=[S, S, F, S, F],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        final_logit_softcapping=30.0,
    ),
    "k_eq_v": dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    "moe": dict(
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        use_double_wide_mlp=True,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """std-0.2 weights; norms, scales and the layer scalars around 1 (Gemma 4 multiplies by
    the weight itself)."""
    torch.manual_seed(seed)
    randomize_weights(model, is_norm=multiplies_by_weight)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # a saved buffer, 1 at init: tested off 1
                b.copy_(0.6 + 0.8 * torch.rand_like(b))


def build(name: str, out: Path) -> Path:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(**{**BASE, **CONFIGS[name]})
    model = Gemma4ForCausalLM(config).float()
    randomize(model, zlib.crc32(name.encode()) % 1000)
    return save_model(model, out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return build_dirs(tmp_path_factory, "gemma4", build, CONFIGS)


def test_shared_kv_is_one_group_and_counted_once(dirs) -> None:
    """(a): the reuse layers 3 (sliding) and 4 (global) point at the groups of layers 1 and 2;
    three groups of two shapes; KV bytes per token count each shared group once."""
    from models.loader import load_spec

    spec = load_spec(str(dirs["shared"]))
    assert [lay.kv_group for lay in spec.layers] == [0, 1, 2, 1, 2]
    assert spec.kv_groups == [(2, 16), (2, 16), (2, 32)]
    assert spec.full_attention_layers == (2, 4) and spec.sliding_window == 8
    # float32: a sliding group 2 * 2 heads * 16 dims * 4 B = 256 bytes a token, a global one 512
    assert spec.kv_bytes_per_token(4) == 2 * 256 + 512 == 1024
    assert spec.kv_bytes_per_token_unshared(4) == 3 * 256 + 2 * 512 == 1792
    # at 64 tokens the two sliding groups keep their window of 8: 512 + 2 * 256 / 8
    assert spec.kv_bytes_per_token_at(64, 4) == 512 + 64
    assert spec.kv_bytes_per_token_at(4, 4) == 1024  # within the window: every token kept
    moe = load_spec(str(dirs["moe"]))  # double-wide on its two reuse layers
    assert [lay.intermediate_size for lay in moe.layers] == [96, 96, 192, 192]
    assert [lay.kv_group for lay in moe.layers] == [0, 1, 0, 1]
    k_eq_v = load_spec(str(dirs["k_eq_v"]))
    assert [(lay.num_kv_heads, lay.head_dim, lay.k_eq_v) for lay in k_eq_v.layers[:2]] == [
        (2, 16, False),
        (1, 32, True),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(name: str, dirs) -> None:
    """Prefill whole and in chunks of 7 (windows and shared groups across chunk boundaries),
    decode under suffix drafts (k pinned: no startup cost measurement, drafts always
    verified); the banner's two KV figures and the windowed groups' own pool for (a)."""
    ref = reference(dirs[name])
    for llm in whole_and_chunked(dirs[name], spec_cost_model=False):
        assert llm.engine.spec.architecture == "Gemma4ForCausalLM"
        if name == "shared":
            info = llm.engine.info
            assert (info.kv_bytes_per_token, info.kv_bytes_per_token_unshared) == (1024, 1792)
            context = info.max_model_len  # the windows' share amortised over the full context
            assert info.kv_bytes_per_token_full_context == round(512 + 512 * 8 / context)
            from server.__main__ import kv_line

            assert f"at the full {context}-token context" in kv_line(info)
            assert info.num_kv_groups == 3
            # the sliding groups (one of them shared) keep only the window's blocks
            assert llm.engine.kv.window is not None
        assert_matches(llm, ref)


@pytest.mark.slow
def test_prefix_hit_preemption_and_speculation_keep_outputs(dirs) -> None:
    """Each shape: a prefix hit, then swaps to the host tier under suffix drafts, the same text
    as a roomy run without speculation."""
    for name in sorted(dirs):
        assert_prefix_hit_swap_and_drafts(str(dirs[name]))


@pytest.mark.slow
def test_conditional_generation_serves_its_language_model(dirs, tmp_path) -> None:
    """(a)'s text model inside a `Gemma4ForConditionalGeneration` (no towers): its
    `text_config` and its weights under `model.language_model.` give the same logits."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = reference(dirs["shared"])
    config = Gemma4Config(text_config=text.config.to_dict(), vision_config=None, audio_config=None)
    model = Gemma4ForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    save_model(model, tmp_path)
    llm = LLM(str(tmp_path), num_kv_blocks=96, block_size=4)
    assert llm.engine.spec.architecture == "Gemma4ForCausalLM"
    prompt = PROMPTS[1]
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor([prompt])).logits[0].float()
    ours = score_prompt(llm.engine, prompt)
    assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()


def test_tensor_parallel_is_refused_with_the_reason(dirs) -> None:
    from models.loader import load_spec
    from models.tp_plan import plan_tensor_parallel

    with pytest.raises(ValueError, match="Gemma 4"):
        plan_tensor_parallel(load_spec(str(dirs["k_eq_v"])), 2)


def _multi_turn_hit_rate(path: Path, num_kv_blocks: int) -> tuple[float, int]:
    """Four conversations of four turns, each turn the whole history (the last answer and a new
    question appended), conversations interleaved so a small pool evicts: cached tokens over
    prompt tokens, and the number of turns that hit."""
    llm = LLM(str(path), num_kv_blocks=num_kv_blocks, block_size=4, num_speculative_tokens=0)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    histories = [[(c * 37 + i * 11) % 400 + 3 for i in range(24)] for c in range(4)]
    cached = prompted = hits = 0
    for turn in range(4):
        for c, history in enumerate(histories):
            out = llm.generate([history], params)[0]
            cached += out.num_cached_tokens
            prompted += len(history)
            hits += out.num_cached_tokens > 0
            history += out.outputs[0].token_ids + [(turn * 13 + c) % 400 + 3 for _ in range(5)]
    return cached / prompted, hits


@pytest.mark.slow
def test_sharing_keeps_the_multi_turn_hit_rate(dirs, tmp_path) -> None:
    """The failure mode of stacks that hash or pool per layer: sharing KV across layers must
    not cost prefix hits. The same shape without sharing (every layer its own group) gets the
    same hit rate on a multi-turn workload, in a roomy pool and in one small enough to evict."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(**{**BASE, **CONFIGS["shared"], "num_kv_shared_layers": 0})
    model = Gemma4ForCausalLM(config).float()
    randomize(model, 7)
    save_model(model, tmp_path)
    rates = {}
    for blocks in (512, 40):
        rates[blocks] = _multi_turn_hit_rate(dirs["shared"], blocks)
        assert rates[blocks] == _multi_turn_hit_rate(tmp_path, blocks), blocks
    assert rates[512][1] == 12  # every turn after the first hits
    assert 0 < rates[40][0] < rates[512][0]  # the small pool evicts (its windows too)
