"""Laguna XS.2 (`LagunaForCausalLM`, issue #68) through the engine against transformers 5.24 on
the same tiny random weights: float32 logits and greedy text (prefill whole and chunked, decode),
a prefix hit, preemption to the host tier, speculation, and two tensor-parallel ranks against one.

Two shapes, both with query heads that change by layer over one KV head count, sliding and full
layers (each type its own rope base and rotated share), experts with a shared expert on the
"sparse" layers and a dense SwiGLU on the others: (a) a gate per head, 8/2 heads at most, the
router's logits soft-capped and its routed sum scaled; (b) a gate per element, one KV head under
2, 3 and 4 query heads (over two ranks: KV replicated on some layers, whole layers moving from
rank to rank on others), tied embeddings, a quarter of the full layers' heads rotated."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from engine import LLM
from tests.conftest import TINY_TEXT, F, S, build_dirs, save_model
from tests.test_model_coverage import (
    GREEDY,
    assert_matches,
    assert_prefix_hit_swap_and_drafts,
    reference,
    reference_greedy,
)

BASE = TINY_TEXT | dict(
    intermediate_size=96,
    head_dim=16,
    sliding_window=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
CONFIGS = {
    "per_head": dict(
        num_hidden_layers=4,
        num_key_value_heads=2,
        num_attention_heads_per_layer=[4, 8, 6, 4],
        layer_types=[S, F, S, F],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        gating="per-head",
        moe_router_logit_softcapping=3.0,
        moe_routed_scaling_factor=2.5,
    ),
    "per_element": dict(
        num_hidden_layers=5,
        num_key_value_heads=1,
        num_attention_heads_per_layer=[2, 3, 2, 4, 3],
        layer_types=[F, S, S, F, S],
        gating="per-element",
        tie_word_embeddings=True,
        mlp_layer_types=["sparse", "dense", "sparse", "sparse", "dense"],
        rope_parameters={
            F: {"rope_type": "default", "rope_theta": 100_000.0, "partial_rotary_factor": 0.25},
            S: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0},
        },
    ),
}
# no startup measurements (step budget, oneDNN packing): ~4 s of CPU an engine, which these
# checks of numbers and tokens do not need
FAST = dict(target_step_ms=-1, cpu_packed_weights=False)


def build(name: str, out: Path) -> Path:
    from transformers import LagunaConfig, LagunaForCausalLM

    model = LagunaForCausalLM(LagunaConfig(**{**BASE, **CONFIGS[name]})).float()
    torch.manual_seed(zlib.crc32(name.encode()) % 1000)
    # norms around 1; std-0.2 embeddings, std-0.1 layer weights (the router's selection bias
    # too): small enough that the text repeats itself and suffix drafts get accepted
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2 if "embed" in pname else 0.1)
        if not model.config.tie_word_embeddings:  # (a)'s head its own tensor, the same values
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    return save_model(model, out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    return build_dirs(tmp_path_factory, "laguna", build, CONFIGS)


def test_geometry_and_the_tensor_parallel_plan(dirs) -> None:
    """Per-layer heads over one KV shape, windows and experts as the configs say; the
    two-rank plan per layer group with a layer's KV bytes per token on each rank."""
    from models.loader import load_spec
    from models.tp_plan import RankShard, plan_tensor_parallel

    a, b = (load_spec(str(dirs[n])) for n in ("per_head", "per_element"))
    assert [lay.num_heads for lay in a.layers] == [4, 8, 6, 4] and a.kv_groups == [(2, 16)] * 4
    assert a.full_attention_layers == (1, 3) and a.sliding_window == 8 and a.has_per_layer_heads
    assert [lay.num_experts for lay in a.layers] == [0, 4, 4, 0]
    assert [lay.intermediate_size for lay in a.layers] == [96, 32, 32, 96]
    # (a) float32: every layer's 2 KV heads split, one each: 2 * 16 dims * 4 B = 128 a rank
    table = plan_tensor_parallel(a, 2).table(a, 4)
    assert table.count("(a layer: 128/128)") == 4
    assert "KV bytes/token by rank, all layers: 512/512" in table
    # (b): 2/1 and 4/1 replicate the one KV head; 3/1 cannot split, its layers take turns
    plan = plan_tensor_parallel(b, 2)
    assert [g.mode for g in plan.groups] == [
        "kv replicated",
        "whole, layer by layer over the ranks",
        "kv replicated",
        "kv replicated",
        "whole, layer by layer over the ranks",
    ]
    table = plan.table(b, 4)
    assert "layers 1-1: 3/1 heads" in table and "(a layer: 128/0)" in table
    assert "(a layer: 0/128)" in table and "all layers: 512/512" in table
    shard = RankShard(b, plan, 1)
    assert [lay.num_heads for lay in shard.spec.layers] == [1, 0, 1, 2, 3]
    # per-element gate rows follow the heads (16 a head); a shared expert's columns are cut
    assert shard.row_ranges("layers.3.g_proj.weight") == [(32, 64)]
    assert shard.spec.extra["shared_expert_intermediate_size"] == 24


def test_refusals_say_why(dirs) -> None:
    from models.laguna import laguna_spec

    cfg = {**BASE, **CONFIGS["per_head"]}
    with pytest.raises(ValueError, match="attention biases"):
        laguna_spec({**cfg, "attention_bias": True}, ())
    with pytest.raises(ValueError, match="multiples of 2"):
        laguna_spec({**cfg, "num_attention_heads_per_layer": [4, 3, 6, 4]}, ())
    with pytest.raises(ValueError, match="yarn"):
        laguna_spec({**cfg, "rope_parameters": {F: {"rope_type": "yarn", "rope_theta": 1.0}}}, ())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(name: str, dirs) -> None:
    """Prefill whole and in chunks of 7 (windows across chunk boundaries), then greedy decode;
    the chunked engine decodes under suffix drafts (k pinned, every draft verified)."""
    ref = reference(dirs[name])
    greedy = reference_greedy(ref)
    for chunk, drafts in ((1024, 0), (7, 4)):
        llm = LLM(
            str(dirs[name]),
            dtype="float32",
            num_kv_blocks=96,
            block_size=4,
            max_num_batched_tokens=chunk,
            num_speculative_tokens=drafts,
            spec_cost_model=False,
            **FAST,
        )
        assert llm.engine.spec.architecture == "LagunaForCausalLM"
        assert_matches(llm, ref, greedy=greedy)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefix_hit_preemption_speculation_and_two_ranks(name: str, dirs) -> None:
    """Against a roomy run without speculation: a prompt's second run hits the prefix cache
    (the same text); a pool too small for the batch swaps to the host tier while suffix drafts
    are verified (some accepted); two tensor-parallel ranks give the same text, with prefix
    hits, and the banner states each layer's KV bytes per rank."""
    path = str(dirs[name])
    prompts, want = assert_prefix_hit_swap_and_drafts(path, **FAST)
    two = LLM(
        path,
        dtype="float32",
        num_kv_blocks=96,
        block_size=4,
        tensor_parallel_size=2,
        num_speculative_tokens=0,
        **FAST,
    )
    try:
        assert [r.outputs[0].token_ids for r in two.generate(prompts, GREEDY)] == want
        assert [r.outputs[0].token_ids for r in two.generate(prompts[:2], GREEDY)] == want[:2]
        assert two.engine.kv.prefix_hits > 0
        table = two.engine.info.kernel_table
        assert "tensor parallel: 2 ranks" in table and "(a layer: 128/128)" in table
    finally:
        two.engine.shutdown()
