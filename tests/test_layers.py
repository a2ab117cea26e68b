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
