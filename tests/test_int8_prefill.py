"""int8 W8A8 for GGUF weights' dense path (`--gguf-int8-prefill`, models/int8_prefill.py): the
two C++ passes against PyTorch, a weight taking it from its rows on, and an engine where the
startup measurement and the accuracy judge decide whether it serves."""

from __future__ import annotations

import re

import pytest
import torch

from engine import LLM
from engine.core.scoring import score_prompt
from engine.weights import int8_dense
from engine.weights.quantization import HeldOut
from kernels.ops import INT8_ROWS
from models.linear import gguf_linear, int8_prefill, measure
from models.linear.gguf_linear import GGUFBlocks, GGUFWeight
from models.linear.int8_prefill import Int8Weight
from tests.test_gguf_blocks import blocks_of

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)


def ops():
    loaded = INT8_ROWS.load()
    assert loaded is not None  # CI has g++ and ninja: a silent fallback would hide a regression
    return loaded


def test_int8_path_only_where_int_mm_is_exact() -> None:
    """The W8A8 copies are made only where `torch._int_mm` measures exact (AVX2 without VNNI:
    saturating sums); elsewhere a weight keeps its float dense path."""
    raw, _ = blocks_of("Q4_1", 48, 64)
    w = GGUFWeight.of(GGUFBlocks("Q4_1", raw, 64, 48, torch.float32), kernel_max_rows=4)
    assert (w.make_int8() > 0) == int8_prefill.int_mm_exact()
    assert (w.int8 is not None) == int8_prefill.int_mm_exact()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_passes_match_pytorch(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # 101 features: whole vectors of 16 and a tail the scalar loop takes
    x = (torch.randn(37, 101, generator=g) * torch.rand(37, 1, generator=g) * 5).to(dtype)
    x[3] = 0  # an all-zero row: scale 0, codes 0
    q, scales = ops().quantize_rows(x)
    want_scales = x.float().abs().amax(1) / 127
    torch.testing.assert_close(scales, want_scales)
    want = torch.round(x.float() / want_scales.clamp_min(1e-30)[:, None]).clamp(-127, 127)
    assert q.dtype == torch.int8 and (q.float() - want).abs().max() <= 1  # ties: x*inv vs x/s
    assert (q[3] == 0).all() and q.abs().max() == 127
    smooth = torch.rand(101, generator=g) + 0.5  # SmoothQuant's factor, fused into the pass
    qs, ss = ops().quantize_rows(x, smooth)
    q_want, s_want = ops().quantize_rows((x.float() * smooth).contiguous())
    torch.testing.assert_close(ss, s_want)
    assert (qs.int() - q_want.int()).abs().max() <= 1  # the product rounded to x's dtype or not
    acc = torch.randint(-(2**20), 2**20, (37, 40), dtype=torch.int32, generator=g)
    cols, bias = torch.rand(40, generator=g), torch.randn(40, generator=g)
    got = ops().scale_rows(acc, scales, cols, bias, dtype)
    expected = acc.float() * scales[:, None] * cols[None] + bias
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_takes_int8_from_its_rows(dtype) -> None:
    """Below `int8_min_rows` the float dense path exactly; from it on int8 W8A8, within int8
    rounding of the same product (per-row activations, per-channel weights)."""
    if not int8_prefill.int_mm_exact():  # refused here: the test above
        return
    raw, ref = blocks_of("Q4_1", 48, 64)
    bias = torch.randn(48)
    w = GGUFWeight.of(GGUFBlocks("Q4_1", raw, 64, 48, dtype, bias), kernel_max_rows=4)
    assert w.make_int8() == 48 * 64 + 48 * 4
    w.int8_min_rows = 40
    x = torch.randn(80, 64).to(dtype)
    assert torch.equal(w(x[:39]), w.dense(x[:39]))
    got = w(x)
    assert torch.equal(got, w.int8(x))
    want = torch.nn.functional.linear(x.float(), ref, bias)
    # blocks_of's first block per row is offset by +0.5: a channel's int8 step is set by it,
    # ~3% of the other weights' spread (real weights have no such block: see the engine test)
    assert torch.nn.functional.cosine_similarity(got.float(), want, dim=-1).min() > 0.995
    # TP slices keep their copy
    part = w.rows(slice(8, 24))
    assert part.int8 is not None and torch.equal(part.int8.weight, w.int8.weight[:, 8:24])


def test_int8_weight_rounds_per_output_channel() -> None:
    dense = torch.randn(6, 32)
    dense[2] *= 100  # one large channel must not coarsen the others
    w = Int8Weight.from_dense(dense)
    back = w.weight.t().float() * w.scales[:, None]
    err = (back - dense).abs().amax(1)
    assert (err <= dense.abs().amax(1) / 254 * 1.001).all()


def test_smoothing_keeps_the_product_and_tames_an_outlier_channel() -> None:
    """A copy smoothed by its inputs' ranges is the same function (the weight's columns carry
    the factor's reciprocal), and rows whose step one outlier channel set come out closer."""
    if not int8_prefill.int_mm_exact():
        return
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(200, 128, generator=g)
    x[:, 7] *= 60  # an outlier channel, as after an RMSNorm with a large gain
    want = x @ dense.t()
    plain = Int8Weight.from_dense(dense)
    smoothing = int8_prefill.smoothing_for(x.abs().amax(0), dense)
    smoothed = Int8Weight.from_dense(dense, smoothing=smoothing)
    assert torch.equal(smoothed.rows(slice(8, 24)).smoothing, smoothing)

    def err(w: Int8Weight) -> float:
        return ((w(x) - want).norm() / want.norm()).item()

    assert err(smoothed) < 0.5 * err(plain)
    assert err(smoothed) < 0.02


@pytest.mark.main_pass_only
def test_engine_measures_and_judges_int8_prefill(llama_dir, monkeypatch) -> None:
    """`on` with the probe's margin at 0 (int8 taken from the smallest bucket whatever the
    timing): the banner has the choice and the judge's figures, a long prompt's prefill runs on
    it and its logits track the float GEMM's; `auto` under a bar no model meets drops the copies."""
    monkeypatch.setattr(measure, "Q8_MARGIN", 0.0)
    monkeypatch.setattr(measure, "_MEASURED_INT8", {})
    common = {"quantization": "int8wo", "num_kv_blocks": 32, "dtype": "float32"}
    llm = LLM(str(llama_dir), gguf_int8_prefill="on", **common)
    table = llm.engine.info.kernel_table
    if not int8_prefill.int_mm_exact():  # an AVX2-only CPU: refused, and the banner says why
        assert "int8 W8A8 dense path unavailable: torch._int_mm is not exact" in table
        assert all(w.int8 is None for w in gguf_linear.gguf_weights(llm.engine.runner.model))
        return
    first = min(measure.INT8_ROW_BUCKETS)
    assert f"int8 W8A8 dense path from {first} rows" in table
    projections = "down_proj, o_proj, gate_up_proj, qkv_proj"
    assert re.search(
        rf"int8 prefill serves on {projections} \(vs the float GEMM on \d+ held-out positions",
        table,
    )
    weights = gguf_linear.gguf_weights(llm.engine.runner.model)
    decoder = [w for w in weights if w.int8 is not None]
    assert decoder and all(w.int8_min_rows == first for w in decoder)
    assert llm.engine.runner.model.lm_head.format.int8 is None  # the head keeps the float path

    calls = []
    matmul = Int8Weight.matmul
    monkeypatch.setattr(
        Int8Weight, "matmul", lambda self, x, b: calls.append(len(x)) or matmul(self, x, b)
    )
    ids = list(range(5, 5 + 3 * first))
    got = score_prompt(llm.engine, ids)
    assert calls and max(calls) >= first
    plain = LLM(str(llama_dir), gguf_int8_prefill="off", **common)
    want = score_prompt(plain.engine, ids)
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99

    monkeypatch.setattr(int8_dense, "INT8_ACTIVATION_TOP1", 1.01)
    monkeypatch.setattr(int8_dense, "_JUDGED", {})
    strict = LLM(str(llama_dir), gguf_int8_prefill="auto", **common)
    assert "int8 prefill refused by the accuracy judge" in strict.engine.info.kernel_table
    assert all(w.int8 is None for w in gguf_linear.gguf_weights(strict.engine.runner.model))


@pytest.mark.main_pass_only
def test_the_judge_drops_the_projection_that_breaks_the_model(llama_dir, monkeypatch) -> None:
    """Where every projection together misses the bar, projections leave in LEAVE_FIRST's order
    until the rest passes: a down projection whose copy is wrong leaves, the others serve."""
    if not int8_prefill.int_mm_exact():
        return
    monkeypatch.setattr(measure, "Q8_MARGIN", 0.0)
    llm = LLM(str(llama_dir), quantization="int8wo", num_kv_blocks=32, gguf_int8_prefill="on")
    runner = llm.engine.runner
    served = gguf_linear.served_weights(runner.model)
    for name, w in served:
        if name.endswith("down_proj"):
            w.int8 = Int8Weight.from_dense(torch.randn(w.kernel.out_features, w.kernel.in_features))
    held = HeldOut(
        runner.model, runner.backend, llm.tokenizer, 32, runner.block_size, runner.device
    )
    monkeypatch.setattr(int8_dense, "INT8_ACTIVATION_TOP1", 0.0)  # tiny random logits: near-ties
    text = int8_dense.judge_int8_dense(held, binding=True)
    assert text.startswith("int8 prefill serves on o_proj, gate_up_proj, qkv_proj (")
    assert "down_proj+o_proj+gate_up_proj+qkv_proj: top-1" in text
    for name, w in served:
        if name.endswith("lm_head"):
            continue
        assert (w.int8 is None) == name.endswith("down_proj"), name
