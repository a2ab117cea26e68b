"""int8 weights on CPU (`--quantization int8`, models/quant.py): the fbgemm W8A8 layer against
float32 arithmetic, the probe that picks activation range, whole-model logits against the float32
engine on the same weights, a Q8_0 GGUF loaded straight into it, and the kernel-matrix row."""

from __future__ import annotations

import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt
from engine.weights.quantization import HELD_OUT, WARN_TOP1, agreement
from models.linear.layer import Linear
from models.linear.w8a8 import can_quantize, int8_weight, needs_reduce_range, quantize_linears

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)


def test_int8_layer_matches_float_within_quantization_error() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * 0.05
    b = torch.randn(96, generator=g) * 0.1
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, 64, generator=g)
        ref = x @ w.t() + b
        got = int8_weight(w, b, needs_reduce_range())(x)
        assert got.shape == ref.shape and got.dtype == torch.float32
        err = (got - ref).norm() / ref.norm()
        assert err < 0.02, (rows, err)
        got_bf16 = int8_weight(w, b, needs_reduce_range())(x.bfloat16())
        assert got_bf16.dtype == torch.bfloat16
        assert ((got_bf16.float() - ref).norm() / ref.norm()) < 0.03


def test_the_probe_keeps_products_exact() -> None:
    """Whatever the probe chose, the product it probes (built to saturate int16 pair sums)
    comes out right; full range is kept only where it is exact."""
    x = torch.full((4, 256), 8.0)
    x[:, 0] = -8.0
    w = torch.ones(16, 256)
    got = int8_weight(w, None, needs_reduce_range())(x)
    assert torch.allclose(got, x @ w.t(), rtol=0.02, atol=1.0)


def test_quantize_linears_skips_the_head_and_drops_float_weights() -> None:
    model = torch.nn.Module()
    model.up = Linear(32, 64)
    model.lm_head = Linear(32, 100)
    for m in (model.up, model.lm_head):
        m.weight.data.normal_()
    quantize_linears(model)
    assert not model.up.dense and model.up.weight.numel() == 0
    assert model.up.pack() == 0  # nothing left to pack
    assert model.lm_head.dense and model.lm_head.weight.numel() == 3200
    assert model.up(torch.randn(5, 32)).shape == (5, 64)


def test_cuda_is_refused_with_a_reason() -> None:
    assert can_quantize(torch.device("cpu")) is None
    assert "CPU path" in can_quantize(torch.device("cuda"))


def _last_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    return torch.stack([score_prompt(llm.engine, p)[-1] for p in prompts])


def test_engine_logits_and_greedy_against_float32(llama_dir, monkeypatch) -> None:
    import engine.weights.quantization as load_quantization

    # a tiny random model's logits are near-tied: its top-1 agreement (0.89 here, cosine 0.998)
    # measures ties, not accuracy; int8's own floor is tested on SmolLM2 below
    monkeypatch.setattr(load_quantization, "WARN_TOP1", load_quantization.REFUSE_TOP1)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 19, 40)]
    ref = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32")
    q = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32", quantization="int8")
    assert "int8 W8A8" in q.engine.info.kernel_table
    a, b = _last_logits(ref, prompts), _last_logits(q, prompts)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cos.min() > 0.99, cos
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = q.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert q.engine.kv.pool.num_free_blocks == q.engine.num_blocks


def _judged(llm: LLM) -> torch.Tensor:
    """Logits at every position of the startup judge's held-out text, through the engine."""
    texts = [llm.tokenizer.encode(t, add_special_tokens=False)[:256] for t in HELD_OUT]
    return torch.cat([score_prompt(llm.engine, ids) for ids in texts])


@pytest.mark.slow
def test_a_q8_0_gguf_loads_into_int8_accurate_or_refused(smollm2_path, tmp_path) -> None:
    """int8 W8A8 serves only where it is accurate, and then exactly as the startup judge said:
    its figures (top-1 agreement and mean cosine on the held-out text) come out again through
    the serving path. Without VNNI (7-bit activations) it is refused, naming the measurement.
    With VNNI SmolLM2 sits at the bar: per-tensor int8 rounding turns a float32 summation-order
    change upstream (1e-7 in one layer's attention) into a quantization step downstream, and the
    verdict moved between 0.85 and 0.92 with the attention kernel alone; either outcome must be
    the judge's, reported as such."""
    from tools.export_gguf import gguf_as

    q8 = gguf_as(smollm2_path, tmp_path / "m.Q8_0.gguf", "Q8_0")
    try:
        q = LLM(str(q8), num_kv_blocks=16, dtype="float32", quantization="int8")
    except ValueError as refused:
        message = str(refused)
        assert "too inaccurate on this CPU" in message
        bits = "7-bit activations (fbgemm without VNNI)" if needs_reduce_range() else "8-bit"
        assert bits in message
        top1 = float(re.search(r"top-1 agreement ([\d.]+)", message).group(1))
        # the message rounds to two places: a refused 0.897 reads "0.90"
        assert top1 <= WARN_TOP1 and "--quantization int8wo" in message
        return
    assert not needs_reduce_range(), "7-bit activations were accepted"
    table = q.engine.info.kernel_table
    line = re.search(r"top-1 agreement ([\d.]+), logit cosine ([\d.]+)", table)
    promised_top1, promised_cosine = float(line.group(1)), float(line.group(2))
    assert promised_top1 >= WARN_TOP1 and "WARNING" not in table
    ref = LLM(str(q8), num_kv_blocks=16, dtype="float32", quantization="none")
    reference, got = _judged(ref), _judged(q)
    top1, cosine = agreement(reference, got)
    # the judge's reference is the smoothed float model (the same function up to rounding): a
    # near-tie may flip one position, and the printed figures are rounded
    assert abs(top1 - promised_top1) <= 1 / len(reference) + 0.005
    assert abs(cosine - promised_cosine) <= 0.002
    prompt = ref.tokenizer.encode("The capital of France is")
    a, b = _last_logits(ref, [prompt]), _last_logits(q, [prompt])
    assert a.argmax() == b.argmax()  # " Paris"


def test_startup_accuracy_check_refuses_below_its_floor(llama_dir, monkeypatch) -> None:
    import engine.weights.quantization as load_quantization

    monkeypatch.setattr(
        load_quantization, "WARN_TOP1", 1.01
    )  # int8's floor: nothing quantized agrees that well
    with pytest.raises(ValueError, match="too inaccurate on this CPU"):
        LLM(str(llama_dir), num_kv_blocks=32, dtype="float32", quantization="int8")


@pytest.mark.parametrize("bad", ["int4", "fp8"])
def test_unknown_quantization_is_refused(llama_dir, bad) -> None:
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(llama_dir), quantization=bad)


def test_smoothing_leaves_the_float_model_unchanged(llama_dir) -> None:
    """SmoothQuant's folding is exact in float: any positive per-channel factors, folded into
    the norms and the up rows, give the same logits (stale packed weight copies are dropped)."""
    from models.linear.w8a8 import smooth

    llm = LLM(str(llama_dir), num_kv_blocks=32, dtype="float32")
    prompt = list(range(5, 40))
    before = score_prompt(llm.engine, prompt)
    model = llm.engine.runner.model
    g = torch.Generator().manual_seed(2)
    ranges = {}
    for layer in model.layers:
        for linear in (layer.qkv_proj, layer.gate_up_proj, layer.down_proj):
            ranges[linear] = torch.rand(linear.in_features, generator=g) * 10 + 0.1
    smooth(model, ranges)
    after = score_prompt(llm.engine, prompt)
    assert (after - before).abs().max() < 1e-3 * before.abs().max()
