"""The CPU linear layer's fast paths (MKL skinny GEMM, oneDNN-packed weights) compute the same
product as `F.linear`, for every row count either path serves, with and without bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.layers import PACKED_MIN_ROWS, Linear, can_pack, pack_linears


@pytest.mark.parametrize("bias", [False, True])
def test_linear_paths_match_f_linear(bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    for packed in (False, True):
        if packed:
            assert pack_linears(layer) == (160 * 96 * 4 if can_pack(layer.weight) else 0)
        for rows in (1, 2, PACKED_MIN_ROWS, 8, 65):
            x = torch.randn(rows, 96)
            want = F.linear(x, layer.weight, layer.bias)
            got = layer(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # a non-contiguous input (a column slice) takes the same paths
        wide = torch.randn(5, 200)
        torch.testing.assert_close(
            layer(wide[:, 10:106]), F.linear(wide[:, 10:106], layer.weight, layer.bias)
        )


def test_packing_skips_what_onednn_cannot_take() -> None:
    layer = Linear(8, 8).to(torch.bfloat16)
    assert layer.pack() == 0 and layer.packed is None


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fused_ops_match_pytorch(rows: int) -> None:
    """The C++ residual-add + RMSNorm and SiLU x up equal their PyTorch definitions (the ops
    must build here: CI has g++ and ninja)."""
    from models import cpu_fused
    from models.layers import add_rms_norm, rms_norm, silu_mul

    assert cpu_fused.load() is not None
    torch.manual_seed(rows)
    x, res, w = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
    with torch.inference_mode():
        total, normed = add_rms_norm(x, res, w, 1e-5)
        torch.testing.assert_close(total, res + x)
        torch.testing.assert_close(normed, rms_norm(res + x, w, 1e-5), rtol=1e-5, atol=1e-5)
        first, normed = add_rms_norm(x, None, w, 1e-5)  # the first layer: no residual yet
        assert first is x
        torch.testing.assert_close(normed, rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
        gate_up = torch.randn(rows, 2 * 48)
        want = F.silu(gate_up[:, :48]) * gate_up[:, 48:]
        torch.testing.assert_close(silu_mul(gate_up), want, rtol=1e-5, atol=1e-5)
    # with autograd on, the PyTorch path runs (the C++ ops have no backward)
    xg = x.clone().requires_grad_()
    total, normed = add_rms_norm(xg, res, w, 1e-5)
    normed.sum().backward()
    assert xg.grad is not None


@pytest.mark.parametrize(
    "module, ext",
    [
        ("models.cpu_fused", "kvserve_cpu_fused"),
        ("engine.attention.cpu_decode", "kvserve_cpu_decode"),
    ],
)
def test_a_stale_build_lock_does_not_hang_startup(module: str, ext: str) -> None:
    """A process killed while compiling the C++ ops leaves torch's `lock` file behind; the next
    start must not wait on it forever (it did: a killed first start hung every later one)."""
    import importlib
    import os
    import subprocess
    import sys
    from pathlib import Path

    ops = importlib.import_module(module)
    assert ops.load() is not None  # built (or found) by this process
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    lock = Path(base) / ext / "lock"
    lock.write_text("")  # what a build killed mid-way leaves
    code = f"import {module} as ops; assert ops.load() is not None"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, timeout=180, check=True)
    assert not lock.exists()
