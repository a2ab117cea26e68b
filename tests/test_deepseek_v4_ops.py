"""DeepSeek V4's C++ decode-step ops (kernels/deepseek_v4.cpp) against the PyTorch code they
stand in for, on the tiny config's layers with random weights (no checkpoint, no transformers):
the hyper-connections' mixing (Sinkhorn projection, collapse, expansion), the RMSNorm + rotary
of queries, keys and output, and the decode rows' attention of CSA (the indexer's top k of more
entries than k), HCA and sliding layers, equal in float32 to rounding; and the startup
measurement that chooses between them. tests/test_deepseek_v4.py runs the engine with them
against transformers."""

from __future__ import annotations

import pytest
import torch

from bench.deepseek_v4_kv import TINY
from engine.build.deepseek_v4_choice import choose_v4_kernels, decode_inputs
from models.deepseek_v4 import DeepseekV4ForCausalLM, deepseek_v4_spec
from models.deepseek_v4_attention import CSA, HCA, SLIDING
from models.deepseek_v4_mix import fused_ops, fused_refusal

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)


@pytest.fixture(scope="module")
def model() -> DeepseekV4ForCausalLM:
    if fused_ops() is None:  # the ops build wherever a compiler is; the suite has one
        raise RuntimeError("kvserve's V4 C++ ops did not build")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(deepseek_v4_spec(TINY, ()))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@torch.inference_mode()
def test_hyper_connections_equal_pytorch(model) -> None:
    for layer in model.layers:
        for hc in (layer.attn_hc, layer.ffn_hc):
            for rows in (1, 5):
                streams = torch.randn(rows, hc.hc, 64)
                out = torch.randn(rows, 64)
                hc.fused = False
                ref = hc(streams)
                ref_next = hc.expand(out, streams, *ref[:2])
                hc.fused = True
                got = hc(streams)
                for a, b in zip(got, ref, strict=True):
                    close(a, b)
                close(hc.expand(out, streams, *ref[:2]), ref_next)
                hc.fused = False
                # the comb is doubly stochastic (to Sinkhorn's tolerance), as the reference's
                assert torch.allclose(got[1].sum(-2), torch.ones(rows, hc.hc), atol=1e-4)


@torch.inference_mode()
def test_sparse_decode_equals_pytorch(model) -> None:
    """Rows of different lengths; CSA rows see 75 down to ~38 entries of which 8 count."""
    kinds = set()
    for layer in model.layers:
        a = layer.attn
        kinds.add(a.kind)
        for rows in (1, 3):
            args = decode_inputs(a, rows, 300, 16, seed=rows)
            close(a.decode_fused(*args), a.attend(*args))
        if a.kind == CSA:  # fewer visible entries than k: every one of them counts
            args = decode_inputs(a, 2, 28, 16)
            close(a.decode_fused(*args), a.attend(*args))
    assert kinds == {CSA, HCA, SLIDING}


@torch.inference_mode()
def test_norm_rope_equals_pytorch(model) -> None:
    """Queries [T, H, D] normalised without a weight, the key [T, D] with one, the output
    rotated back (sin negated) without a norm; rows at positions far apart."""
    a = model.layers[0].attn
    freqs = torch.arange(5).float()[:, None] * 997 * torch.rand(1, a.rotary_pairs)
    cos, sin = freqs.cos(), freqs.sin()
    q, kv = torch.randn(5, a.heads, a.hd), torch.randn(5, a.hd)
    for x, normalise, weight, s in (
        (q, True, None, sin),
        (kv, True, a.kv_norm, sin),
        (q, False, None, -sin),
    ):
        a.fused_rope = False
        ref = a.norm_rope(x, normalise, weight, cos, s)
        a.fused_rope = True
        close(a.norm_rope(x, normalise, weight, cos, s), ref)
    a.fused_rope = False


def test_the_choice_is_measured_and_set(model) -> None:
    line = choose_v4_kernels(model, torch.float32, torch.device("cpu"), 4, 16, 300)
    parts = dict(part.split(": ", 1) for part in line.split("; "))
    assert set(parts) == {
        "hyper-connections",
        "RMSNorm + rotary",
        "CSA decode at 300 tokens",
        "HCA decode at 300 tokens",
        "window decode at 300 tokens",
    }
    assert all("1 row PyTorch" in p and "4 rows PyTorch" in p for p in parts.values())
    served = parts["hyper-connections"].startswith("the C++ op")
    assert all(layer.attn_hc.fused == served for layer in model.layers)
    csa = parts["CSA decode at 300 tokens"].startswith("the C++ op")
    assert [layer.attn.fused for layer in model.layers][::3] == [csa, csa]
    served = parts["RMSNorm + rotary"].startswith("the C++ op")
    assert all(layer.attn.fused_rope == served for layer in model.layers)
    assert fused_refusal(torch.bfloat16, torch.device("cpu")) == (
        "the C++ ops take float32 (torch.bfloat16 serves)"
    )
    assert choose_v4_kernels(model, torch.bfloat16, torch.device("cpu"), 4, 16, 300).startswith(
        "PyTorch (the C++ ops take float32"
    )
