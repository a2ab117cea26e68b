"""A GGUF's quantized matrices served as stored (issue #28, models/gguf_linear.py): the C++ block
kernel and dequantizer against the `gguf` package's own dequantization, for Q4_0, Q4_1 and Q8_0
and every row-group path of the kernel; and the shipped SmolLM2 Q4_1 file served that way
against the same file dequantized to float32 (the same weights: the logits agree to float32
rounding, and greedy text is identical)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from models.linear import gguf_linear
from models.linear.gguf_linear import FORMATS, GGUFBlocks, GGUFWeight

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

OPS = gguf_linear.load()
Q8 = gguf_linear.load_q8()
needs_ops = pytest.mark.skipif(OPS is None, reason="kvserve's C++ ops cannot be built here")
needs_q8 = pytest.mark.skipif(Q8 is None, reason="the int8-activation kernel needs AVX2")


def blocks_of(fmt: str, out_features: int, in_features: int, seed: int = 0):
    """(raw ggml blocks as a uint8 tensor, the gguf package's float32 dequantization)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    w[:, :32] += 0.5  # blocks with a non-zero mean: Q4_1's minimum matters
    qtype = GGMLQuantizationType[fmt]
    raw = quantize(w, qtype)
    ref = dequantize(raw, qtype).reshape(out_features, in_features).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(ref)


@needs_ops
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_is_the_gguf_packages(fmt) -> None:
    raw, ref = blocks_of(fmt, 40, 96)
    assert torch.equal(OPS.dequantize(raw, FORMATS[fmt], 96), ref)


@needs_ops
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
def test_kernel_matches_the_dequantized_product(fmt, rows) -> None:
    raw, ref = blocks_of(fmt, 72, 160, seed=rows)
    x = torch.randn(rows, 160)
    got = OPS.linear(x, raw, FORMATS[fmt])
    want = x @ ref.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # rows are computed in groups of up to 8; a row's sum must not depend on its group, or a
    # verify step's rows would differ from the same tokens decoded one at a time
    one_by_one = torch.cat([OPS.linear(x[i : i + 1], raw, FORMATS[fmt]) for i in range(rows)])
    assert torch.equal(got, one_by_one)


@needs_ops
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_kernel_on_bf16_activations_is_the_bf16_product(fmt, rows) -> None:
    """bf16 activations: the float32 product of the same bf16 values, then one bf16 rounding of
    the output."""
    raw, ref = blocks_of(fmt, 72, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = OPS.linear(x, raw, FORMATS[fmt])
    want = x.float() @ ref.T
    assert got.dtype == torch.bfloat16
    # one bf16 rounding (2^-8 relative) plus float32 sums in another order
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()


@needs_q8
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 19])
def test_interleaved_float_kernel_matches_the_dequantized_product(fmt, rows) -> None:
    """The float-activation kernel on the interleaved copy (what serves where AVX2 is): the
    dequantized product up to float32 summation, padding rows dropped, each row independent of
    its batch; bf16 activations give the float32 product of the same values rounded once
    (on AVX512-BF16, `bf16_dot`, through the pair-dot kernel: rows in groups of up to 8)."""
    raw, ref = blocks_of(fmt, 72, 160, seed=rows)
    packed = Q8.repack(raw, FORMATS[fmt])
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    got = Q8.linear_float(x, packed, FORMATS[fmt], 72)
    torch.testing.assert_close(got, x @ ref.T, rtol=1e-5, atol=1e-5)
    alone = [Q8.linear_float(x[i : i + 1], packed, FORMATS[fmt], 72) for i in range(rows)]
    assert torch.equal(got, torch.cat(alone))
    xb = x.bfloat16()
    got_bf16 = Q8.linear_float(xb, packed, FORMATS[fmt], 72)
    want = xb.float() @ ref.T
    assert got_bf16.dtype == torch.bfloat16
    assert ((got_bf16.float() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()
    alone = [Q8.linear_float(xb[i : i + 1], packed, FORMATS[fmt], 72) for i in range(rows)]
    assert torch.equal(got_bf16, torch.cat(alone))


@needs_q8
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bf16_kernel_is_exact_before_its_rounding(fmt) -> None:
    """bf16 activations times small integer codes are exact in float32, so before the output's
    one bf16 rounding the kernel is the float32 product up to summation order: with a float32
    output requested through a bf16 row of exactly representable values, the sums agree to
    float32 rounding (a wrong code, pair or minimum term is off by far more)."""
    raw, ref = blocks_of(fmt, 72, 160, seed=3)
    packed = Q8.repack(raw, FORMATS[fmt])
    xb = torch.randn(9, 160, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = Q8.linear_float(xb, packed, FORMATS[fmt], 72).float()
    want = (xb.double() @ ref.double().T).bfloat16().float()
    # at most one bf16 step apart: the float32 sums may land across a rounding boundary
    step = want.abs() * 2**-7 + 1e-6
    assert ((got - want).abs() <= step).all()
    assert (got == want).float().mean() > 0.9


@needs_q8
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_row_is_summed_alike_in_any_batch(fmt) -> None:
    """A row's float32 sums run in one order whatever rows share its kernel group, so a verify
    step's rows equal the same tokens decoded one at a time (long rows: 64 blocks). Sharp for
    float32 activations; for bf16 ones an order that changed shows only where it moves an
    output across a bf16 rounding boundary (the bf16 kernel's order is fixed by construction:
    the same chains at every group size, gguf_q8_bf16.h)."""
    raw, _ = blocks_of(fmt, 256, 2048, seed=7)
    packed = Q8.repack(raw, FORMATS[fmt])
    x = torch.randn(9, 2048, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        alone = torch.cat(
            [Q8.linear_float(xs[i : i + 1], packed, FORMATS[fmt], 256) for i in range(9)]
        )
        for rows in (2, 3, 4, 5, 8, 9):
            assert torch.equal(Q8.linear_float(xs[:rows], packed, FORMATS[fmt], 256), alone[:rows])


def int8_activation_product(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """llama.cpp's numerics in float64: each activation row rounded to int8 per block of 32
    (scale max|x| / 127), times the dequantized weights."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(xb / scale.clamp_min(1e-30)), 0.0)
    return ((codes * scale).reshape(x.shape) @ ref.double().T).float()


@needs_q8
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9])
def test_int8_activation_kernel_is_llama_cpp_numerics(fmt, rows) -> None:
    """The repacked kernel's product is the int8-rounded activations times the weights, up to
    float32 summation (72 output rows: not a whole group of interleaved rows, so the padding
    is exercised), and a row's result does not depend on the rows beside it."""
    raw, ref = blocks_of(fmt, 72, 160, seed=rows)
    packed = Q8.repack(raw, FORMATS[fmt])
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    got = Q8.linear(x, packed, FORMATS[fmt], 72)
    torch.testing.assert_close(got, int8_activation_product(x, ref), rtol=1e-5, atol=1e-5)
    one_by_one = torch.cat([Q8.linear(x[i : i + 1], packed, FORMATS[fmt], 72) for i in range(rows)])
    assert torch.equal(got, one_by_one)


@needs_q8
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
def test_int8_activation_kernel_is_within_activation_rounding(fmt, rows) -> None:
    """Activations rounded to int8 per block of 32 (llama.cpp's scheme): each activation moves
    by at most half its block's step (max|x| / 254), so each output by at most the sum over
    blocks of that step times the block's |w|. A wrong code, sign or minimum term breaks it."""
    raw, ref = blocks_of(fmt, 72, 160, seed=rows)
    packed = Q8.repack(raw, FORMATS[fmt])
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).float()
        got = Q8.linear(x.to(dtype), packed, FORMATS[fmt], 72)
        assert got.dtype == dtype
        want = xd @ ref.T
        half_step = xd.reshape(rows, -1, 32).abs().amax(-1) / 254  # [rows, blocks]
        w_abs = ref.abs().reshape(72, -1, 32).sum(-1)  # [out, blocks]
        bound = half_step @ w_abs.T + 1e-4 + (2**-8 * want.abs() if dtype != torch.float32 else 0)
        assert ((got.float() - want).abs() <= bound * 1.01).all()
    zero = Q8.linear(torch.zeros(rows, 160), packed, FORMATS[fmt], 72)
    assert torch.equal(zero, torch.zeros(rows, 72))  # an all-zero block has scale 0


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_takes_kernel_or_dense_path_by_rows_with_bias(dtype) -> None:
    raw, ref = blocks_of("Q4_1", 48, 64)
    bias = torch.randn(48)
    w = GGUFWeight.of(GGUFBlocks("Q4_1", raw, 64, 48, dtype, bias), kernel_max_rows=4)
    for packed in (False, True):
        if packed and not w.pack():
            continue  # oneDNN does not pack this dtype here: the dequantizing path serves
        for rows in (1, 4, 5, 33):  # kernel, kernel, dense, dense
            x = torch.randn(rows, 64).to(dtype)
            got = w(x)
            want = torch.nn.functional.linear(x.float(), ref, bias)
            assert got.dtype == dtype and got.shape == (rows, 48)
            tol = 1e-4 if dtype == torch.float32 else 0.05
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def smol_pair(smollm2_path):
    """The shipped Q4_1 file served as stored (on float activations: the exact kernel) and
    dequantized, both float32 (numbers only: the step budget and speculation costs are not
    measured, tests of their own do that)."""
    unmeasured = {"target_step_ms": -1, "spec_cost_model": False}
    native = LLM(
        smollm2_path,
        num_kv_blocks=16,
        dtype="float32",
        quantization="auto",
        gguf_int8_activations="off",
        **unmeasured,
    )
    dense = LLM(smollm2_path, num_kv_blocks=16, dtype="float32", quantization="none", **unmeasured)
    return native, dense


@needs_ops
@pytest.mark.slow
def test_shipped_q4_1_is_served_as_stored(smol_pair) -> None:
    native, dense = smol_pair
    table = native.engine.info.kernel_table
    assert "GGUF blocks as stored (Q4_1 " in table and "Q8_0 " in table  # lm_head: Q8_0 embedding
    assert "kernel up to" in table  # the measured crossover
    assert "GGUF blocks" not in dense.engine.info.kernel_table
    model = native.engine.runner.model
    assert model.layers[0].qkv_proj.weight.numel() == 0  # no float copy held
    head = model.lm_head.format
    assert isinstance(head, GGUFWeight) and head.kernel.format == "Q8_0"
    # --gguf-int8-activations off: float activations for every row
    blocks = gguf_linear.gguf_weights(model)
    assert blocks and all(w.q8_max_rows == 0 for w in blocks)


@needs_ops
@pytest.mark.slow
def test_shipped_q4_1_agrees_with_its_float32_dequantization(smol_pair) -> None:
    native, dense = smol_pair
    tok = native.tokenizer
    prompts = [
        tok.encode("The mitochondria is the part of the cell that"),
        tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ]
    for p in prompts:  # every position: prefill takes the dense path, logits the same weights
        a, b = score_prompt(dense.engine, p), score_prompt(native.engine, p)
        assert (a.argmax(-1) == b.argmax(-1)).all()
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.9999
    # decode rows through the exact block kernel: the dense model's greedy text
    weights = gguf_linear.gguf_weights(native.engine.runner.model)
    saved = [(w.q8_max_rows, w.kernel_max_rows) for w in weights]
    for w in weights:
        w.q8_max_rows, w.kernel_max_rows = 0, 8
    try:
        params = SamplingParams(temperature=0, max_tokens=24)
        msgs = [[{"role": "user", "content": "What is the capital of France?"}]]
        got = native.chat(msgs, params)[0].outputs[0].text
        assert got == dense.chat(msgs, params)[0].outputs[0].text
    finally:
        for w, (q8, kernel) in zip(weights, saved):
            w.q8_max_rows, w.kernel_max_rows = q8, kernel


@needs_ops
@pytest.mark.slow
def test_int8_activation_head_tracks_the_float_head(smol_pair) -> None:
    """The lm_head on int8-rounded activations, one decode row at a time, against the dense head
    over every position of held-out text."""
    native, _ = smol_pair
    tok = native.tokenizer
    ids = tok.encode("In 1969, Neil Armstrong became the first person to walk on the Moon.")
    hidden = _final_hidden(native, ids)
    head = native.engine.runner.model.lm_head.format
    if head.kernel.interleaved is None:
        pytest.skip("the int8-activation kernel needs AVX2")
    q8 = torch.cat([head.kernel_q8(h[None]) for h in hidden]).float()
    exact = torch.cat([head.kernel(h[None]) for h in hidden]).float()
    ref = torch.nn.functional.linear(hidden.float(), head.kernel.dequantized(torch.float32))
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-3)
    assert torch.nn.functional.cosine_similarity(q8, ref, dim=-1).min() > 0.999
    assert (q8.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def _final_hidden(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The model's final hidden rows (after the norm) for a prompt, one prefill."""
    from engine.runner.step_inputs import step_metadata

    runner = llm.engine.runner
    bs = llm.engine.block_size
    table = list(range(-(-len(ids) // bs)))
    positions, meta = step_metadata([(table, 0, len(ids))], bs, runner.device)
    with torch.inference_mode():
        return runner.model(torch.tensor(ids), positions, runner.backend.plan(meta))


@needs_ops
def test_safetensors_quantized_at_load_to_q8_0_blocks(llama_dir) -> None:
    """`--quantization int8wo` on a float checkpoint: its linear weights rounded to Q8_0 blocks
    at load, measured against the float model, then served (greedy tokens against the float
    engine's: the first agrees; later ones may part at the tiny model's near-ties)."""
    ref = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32")
    q = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32", quantization="int8wo")
    table = q.engine.info.kernel_table
    assert "weight-only int8wo: ggml blocks rounded at load (Q8_0 " in table
    assert float(table.split("top-1 agreement ")[1].split(",")[0]) >= 0.9
    model = q.engine.runner.model
    assert model.layers[0].gate_up_proj.weight.numel() == 0
    assert model.layers[0].gate_up_proj.format.kernel.format == "Q8_0"
    assert model.lm_head.format.kernel.format == "Q8_0"
    prompts = [[5, 17, 99, 3, 250], list(range(10, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in q.generate(prompts, params)]
    assert [x[0] for x in a] == [x[0] for x in b]
    assert all(len(x) == 6 for x in b)
    assert q.engine.kv.pool.num_free_blocks == q.engine.num_blocks


@needs_ops
def test_int4_at_load_is_measured_and_refused_where_it_breaks_the_model(llama_dir) -> None:
    """The tiny random model (std-0.2 weights, near-ties everywhere) loses half its top-1
    tokens to Q4_1 rounding: the startup check refuses it, saying why."""
    with pytest.raises(ValueError, match="--quantization int4 is too inaccurate"):
        LLM(str(llama_dir), num_kv_blocks=32, dtype="float32", quantization="int4")


@pytest.mark.main_pass_only  # its AVX2 kernel: the kernel tests and smol_pair's tests
@needs_ops
@pytest.mark.slow
def test_int4_at_load_serves_smollm2(smollm2_path) -> None:
    q = LLM(
        smollm2_path,
        num_kv_blocks=16,
        dtype="float32",
        quantization="int4",
        target_step_ms=-1,
        spec_cost_model=False,
    )
    table = q.engine.info.kernel_table
    assert "weight-only int4: ggml blocks rounded at load (Q4_1 " in table
    assert float(table.split("top-1 agreement ")[1].split(",")[0]) >= 0.9
    # (the chat question has a near-tie at its first token: "The" 25.33 vs "L" 25.24 in float32)
    out = q.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))
    assert "Paris" in out[0].outputs[0].text


# settings; the int8 kernel on AVX2: test_int8_activation_kernel_is_within_activation_rounding
@pytest.mark.main_pass_only
@needs_ops
@pytest.mark.slow
def test_int8_activations_are_timed_and_limited_by_the_probe(smollm2_path) -> None:
    """--gguf-int8-activations on: the probe times the int8-activation kernel too, and each group's
    weights take the limit the banner reports."""
    import re

    llm = LLM(smollm2_path, num_kv_blocks=16, dtype="float32", gguf_int8_activations="on")
    table = llm.engine.info.kernel_table
    assert "float/dense/int8-activation" in table
    limits = dict(
        re.findall(
            r"(decoder layers|lm_head) \(\d+ weights\): block kernel up to "
            r"\d+ rows \(int8 activations up to (\d+)\)",
            table,
        )
    )
    model = llm.engine.runner.model
    assert int(limits["lm_head"]) == model.lm_head.format.q8_max_rows
    assert int(limits["decoder layers"]) == model.layers[0].qkv_proj.format.q8_max_rows


@pytest.mark.main_pass_only
@needs_q8
def test_int8_activations_serve_only_where_the_judge_accepts_them(llama_dir, monkeypatch) -> None:
    """--gguf-int8-activations auto: the judge measures the int8-activation model
    against float activations on held-out text; its figures are in the banner and its verdict
    decides what serves (a bar no model can meet drops the int8 kernel everywhere)."""
    import re

    from engine.weights import quantization

    def served(llm: LLM) -> list[GGUFWeight]:
        return gguf_linear.gguf_weights(llm.engine.runner.model)

    judged = {"quantization": "int8wo", "gguf_int8_activations": "auto"}
    llm = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32", **judged)
    table = llm.engine.info.kernel_table
    verdict = re.search(
        r"int8 activations (serve where faster|refused by the accuracy judge) "
        r"\(vs float activations on \d+ held-out positions: top-1 agreement "
        r"([0-9.]+), logit cosine ([0-9.]+)",
        table,
    )
    if verdict is None:  # the probe found the int8 kernel slower everywhere: nothing to judge
        assert all(w.q8_max_rows == 0 for w in served(llm))
    else:
        top1, cosine = float(verdict.group(2)), float(verdict.group(3))
        accepted = top1 >= quantization.INT8_ACTIVATION_TOP1 and (
            cosine >= quantization.INT8_ACTIVATION_COSINE
        )
        assert (verdict.group(1) == "serve where faster") == accepted
        assert any(w.q8_max_rows for w in served(llm)) == accepted
    monkeypatch.setattr(quantization, "INT8_ACTIVATION_TOP1", 1.01)
    monkeypatch.setattr(quantization, "_JUDGED", {})
    strict = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32", **judged)
    assert all(w.q8_max_rows == 0 for w in served(strict))
    if verdict is not None:
        assert "int8 activations refused by the accuracy judge" in strict.engine.info.kernel_table
