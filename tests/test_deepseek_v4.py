"""DeepSeek V4 (`DeepseekV4ForCausalLM`, issue #70) through the engine against transformers 5.24
on the same tiny random weights: CSA, HCA and sliding layers mixed, a window of 16, CSA entries
every 4 tokens (top 8 of them per query), HCA entries every 32 (more than a 16-token block, so a
prefix hit can end inside a compression window), hyper-connections, hash-routed and top-k experts.

One transformers run (a 300-token prompt's logits and greedy tokens) is shared by every check;
the engines are small and share what they can."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from bench.deepseek_v4_kv import TINY
from engine import LLM
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scoring import score_prompt
from tests.conftest import build_tokenizer

if TYPE_CHECKING:
    from transformers import DeepseekV4ForCausalLM

# bench/deepseek_v4_kv.py's tiny model (its KV layout report and step bench run the same one),
# with special tokens and a shorter context
CONFIG = {
    **TINY,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# no startup measurements (step budget, oneDNN packing): these checks of numbers need none
FAST = dict(
    target_step_ms=-1,
    cpu_packed_weights=False,
    spec_cost_model=False,
    dtype="float32",
    block_size=16,
)
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPT = [(i * 37 + 11) % 509 + 3 for i in range(300)]


def build(out: Path, config: dict = CONFIG) -> DeepseekV4ForCausalLM:
    """The tiny random checkpoint of `config` (and its tokenizer) at `out`; returns the
    transformers model."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # sinks, position biases, the hyper-connections' and routers' too
                p.normal_(0.0, 0.2 if "embed" in name else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, 4, b.shape))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(out)
    build_tokenizer(out)
    return model


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The checkpoint, and transformers' logits and greedy tokens for PROMPT."""
    out = tmp_path_factory.mktemp("dsv4")
    model = build(out)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)
    return out, logits, greedy[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def chunked(ref):
    """Chunks of 70 tokens: every compression window size splits across chunks."""
    return LLM(str(ref[0]), num_kv_blocks=96, max_num_batched_tokens=70, **FAST)


def test_groups_and_the_kernel_matrix(ref, chunked) -> None:
    """Each layer type its KV groups, with its own bytes per block; the GPU backends refuse
    compressed and sparse attention with the reason, the torch backend serves them."""
    spec = chunked.engine.spec
    roles = [(g.role, g.width, g.rate, g.windowed) for g in spec.group_specs]
    assert roles == [
        ("window", 32, 1, True),
        ("rows", 4 * 32 + 4 * 16, 1, True),
        ("csa", 32 + 16, 4, False),
        ("window", 32, 1, True),
        ("rows", 2 * 32, 1, False),
        ("hca", 32, 32, False),
        ("window", 32, 1, True),
        ("window", 32, 1, True),
        ("rows", 192, 1, True),
        ("csa", 48, 4, False),
    ]
    caches = chunked.engine.runner.backend.kv_caches
    assert caches[2].shape[3:] == (16 // 4, 48) and caches[5].shape[3:] == (1, 32)
    table = chunked.engine.info.kernel_table
    assert "compressed attention" in table and "sparse attention" in table
    assert "flashinfer / compressed attention: no kernel here reads compressed KV" in table
    assert "xformers / sparse attention: no lightning-indexer top-k" in table
    assert "-> torch" in table


def test_logits_and_greedy_match_transformers(ref, chunked) -> None:
    """The whole prompt in one step (logits) and in chunks of 70, then decode across window
    boundaries (greedy tokens) batched with a shorter request, equal to transformers; every
    block back in the pool after."""
    _, logits, greedy = ref
    ours = score_prompt(chunked.engine, PROMPT)
    assert (ours - logits).abs().max().item() < 1e-4 * logits.abs().max().item()
    both = chunked.generate([PROMPT, PROMPT[:37]], GREEDY)
    assert both[0].outputs[0].token_ids == greedy
    assert chunked.engine.kv.pool.num_free_blocks == chunked.engine.num_blocks


@contextmanager
def cpp_everywhere(llm: LLM) -> Iterator[None]:
    """The C++ ops serve every part of the decode step, whatever the startup measurement chose."""
    flags = [
        (m, name)
        for m in llm.engine.model.modules()
        for name in ("fused", "fused_rope")
        if hasattr(m, name)
    ]
    chosen = [getattr(m, name) for m, name in flags]
    try:
        for m, name in flags:
            setattr(m, name, True)
        yield
    finally:
        for (m, name), was in zip(flags, chosen, strict=True):
            setattr(m, name, was)


def test_greedy_with_the_cpp_decode_step(ref, chunked, monkeypatch) -> None:
    """The startup measurement's line is in the kernel matrix; with the C++ ops serving every
    part of the decode step (whatever it chose), decode across window boundaries batched with a
    shorter request (rows of different lengths in one call of the op) is still transformers'
    greedy text."""
    from models.deepseek_v4_attention import V4Attention

    _, _, greedy = ref
    rows: list[int] = []  # each call's decode rows (a failed batched call is retried row by row)
    real = V4Attention.decode_fused

    def counted(self, q, *args):
        out = real(self, q, *args)
        rows.append(q.shape[0])
        return out

    monkeypatch.setattr(V4Attention, "decode_fused", counted)
    line = next(x for x in chunked.engine.info.kernel_table.splitlines() if "decode step:" in x)
    for part in (
        "hyper-connections: ",
        "RMSNorm + rotary: ",
        "CSA decode at ",
        "HCA decode at ",
        "window decode at ",
    ):
        assert part in line
    with cpp_everywhere(chunked):
        both = chunked.generate([PROMPT, PROMPT[:37]], GREEDY)
    assert both[0].outputs[0].token_ids == greedy
    assert max(rows) == 2


# a prompt whose cached part (9 blocks of 16: 144 tokens) ends halfway through an HCA window
# of 32, one that is a shorter prefix of PROMPT, one that repeats (suffix drafts get accepted)
PROMPTS = [PROMPT[:152] + [7, 8, 9] * 10, PROMPT[:100], [5, 6, 7, 8] * 20, PROMPT]
LONGER = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(ref) -> list[list[int]]:
    """PROMPTS' greedy tokens without prefix caching, speculation or preemption."""
    llm = LLM(
        str(ref[0]), num_kv_blocks=96, enable_prefix_caching=False, num_speculative_tokens=0, **FAST
    )
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, LONGER)]


def test_prefix_hit_mid_window_and_speculation(ref, chunked, plain) -> None:
    """After PROMPT ran, its full blocks are prefix hits carrying their compressed entries (the
    open HCA window recomputed from the rows the hit brings, windowed groups from their own
    pool); suffix drafts are verified and some accepted: the text is the plain run's."""
    chunked.generate([PROMPT], LONGER)
    res = chunked.generate(PROMPTS, LONGER)
    assert [r.outputs[0].token_ids for r in res] == plain
    assert [r.num_cached_tokens for r in res][:2] == [144, 96]
    assert chunked.engine.drafter.total_stats().num_accepted_tokens > 0
    assert chunked.engine.kv.window is not None  # the windowed groups' blocks went back


def test_disk_tier_transfer_and_preemption(ref, plain, tmp_path) -> None:
    """The disk tier brings a prompt's blocks of every group back after a restart; the blocks
    a prefill instance publishes (P/D: exported to bytes, the store's payloads) are a decode
    instance's prefix hit; in a pool too small for the batch, preempted requests swap their
    blocks to the host tier and back while speculating. The text is the plain run's throughout."""
    kw = dict(
        num_kv_blocks=40,
        host_bytes="1MiB",
        disk_path=str(tmp_path / "kv"),
        num_speculative_tokens=0,
        kv_hash_seed="dsv4",
        **FAST,
    )
    first = LLM(str(ref[0]), **kw)
    assert first.generate([PROMPT], LONGER)[0].outputs[0].token_ids == plain[3]
    first.engine.shutdown()  # flushes the host tier to disk
    second = LLM(str(ref[0]), **kw)
    warm = second.generate([PROMPT], LONGER)[0]
    assert warm.outputs[0].token_ids == plain[3] and warm.num_cached_tokens == 288
    assert second.engine.kv.hits_by_source["disk"] > 0
    # P/D: a prompt the prefill instance computed, its blocks as the store's payloads
    other = [(i * 53 + 5) % 500 + 3 for i in range(200)]
    want = second.generate([other], LONGER)[0].outputs[0].token_ids
    blocks = second.engine.kv.export_prompt(Request("pd", other, LONGER, frozenset(), 4096))
    assert len(blocks) == len(other) // 16
    tight = LLM(
        str(ref[0]),
        num_kv_blocks=22,
        max_num_batched_tokens=70,
        host_bytes="16MiB",
        preemption_mode="swap",
        num_speculative_tokens=4,
        kv_hash_seed="dsv4",
        **FAST,
    )
    assert [r.outputs[0].token_ids for r in tight.generate(PROMPTS, LONGER)] == plain
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.kv.import_blocks(blocks) == len(blocks)
    got = tight.generate([other], LONGER)[0]
    assert got.outputs[0].token_ids == want and got.num_cached_tokens == 192
    assert tight.engine.kv.hits_by_source["remote"] == 192  # counted as the store's


def test_what_is_refused_says_why(ref, chunked) -> None:
    """Configurations kvserve does not serve for V4 are startup errors with the reason."""
    from engine.attention import DeviceFacts, select_backend
    from models.deepseek_v4 import deepseek_v4_spec

    rope = {"main": {"rope_type": "default"}, "compress": {"rope_type": "dynamic", "factor": 4}}
    with pytest.raises(ValueError, match="compress rope 'dynamic' is not supported"):
        deepseek_v4_spec({**CONFIG, "rope_parameters": rope}, ())
    with pytest.raises(ValueError, match="gptq quantized weights are not supported"):
        deepseek_v4_spec({**CONFIG, "quantization_config": {"quant_method": "gptq"}}, ())
    spec = chunked.engine.spec
    with pytest.raises(ValueError, match="compressed KV groups are stored in the serving dtype"):
        select_backend(spec, DeviceFacts("cpu"), torch.float32, 16, kv_dtype=torch.int8)
    with pytest.raises(ValueError, match="EAGLE draft head over DeepseekV4ForCausalLM"):
        LLM(str(ref[0]), speculative_method="eagle", speculative_model="x", **FAST)
    with pytest.raises(ValueError, match="its layers do not take LoRA adapters"):
        LLM(str(ref[0]), lora_modules=["a=x"], **FAST)
