"""The CPU linear layer's fast paths (MKL skinny GEMM, oneDNN-packed weights) compute the same
product as `F.linear`, for every row count either path serves, with and without bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.build import COMPLETE, CppOps
from kernels.ops import BY_NAME, CPU_FUSED
from models.linear.dense import PACKED_MIN_ROWS, DensePlain, can_pack
from models.linear.layer import Linear, pack_linears

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_paths_match_f_linear(bias: bool, dtype: torch.dtype) -> None:
    """float32 to 1e-4; bfloat16 (packed and unpacked alike round the float32-accumulated
    product to bf16 once) against float32 arithmetic on the same bf16 inputs to 2 bf16 ulps."""
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    layer.to(dtype)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0.1}
    size = dtype.itemsize

    def reference(x: torch.Tensor) -> torch.Tensor:
        b = layer.bias.float() if layer.bias is not None else None
        return F.linear(x.float(), layer.weight.float(), b).to(dtype)

    for packed in (False, True):
        if packed:
            assert pack_linears(layer) == (160 * 96 * size if can_pack(layer.weight) else 0)
        for rows in (1, 2, PACKED_MIN_ROWS[torch.float32], 8, 65):
            x = torch.randn(rows, 96).to(dtype)
            want = reference(x)
            got = layer(x)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got, want, **tol)
        # a non-contiguous input (a column slice) takes the same paths
        wide = torch.randn(5, 200).to(dtype)
        torch.testing.assert_close(layer(wide[:, 10:106]), reference(wide[:, 10:106]), **tol)


def test_packing_skips_what_onednn_cannot_take() -> None:
    layer = Linear(8, 8).to(torch.float16)  # float32 and bfloat16 are packed; float16 is not
    assert layer.pack() == 0 and isinstance(layer.method, DensePlain)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fused_ops_match_pytorch(rows: int) -> None:
    """The C++ residual-add + RMSNorm and SiLU x up equal their PyTorch definitions (the ops
    must build here: CI has g++ and ninja)."""
    from models.layers import add_rms_norm, rms_norm, silu_mul

    assert CPU_FUSED.load() is not None
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


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_fused_ops_bf16_match_float32_math(rows: int) -> None:
    """bf16 through the C++ ops (float32 arithmetic, one rounding to bf16 per output): the sum
    equals bf16(res + x) exactly; the norm and SiLU x up are within one bf16 rounding (2**-8
    relative, plus the sum's own rounding) of the float32 result on the same bf16 inputs, and
    closer to it than PyTorch's op-by-op bf16 path is (which rounds after every op)."""
    from models.layers import add_rms_norm, rms_norm, silu_mul

    assert CPU_FUSED.load() is not None
    torch.manual_seed(rows)
    bf = torch.bfloat16
    x, res, w = (torch.randn(rows, 96).to(bf), torch.randn(rows, 96).to(bf), torch.randn(96).to(bf))
    with torch.inference_mode():
        total, normed = add_rms_norm(x, res, w, 1e-5)
        assert total.dtype == normed.dtype == bf
        torch.testing.assert_close(total, res + x, rtol=0, atol=0)
        want = rms_norm(total.float(), w.float(), 1e-5)
        torch.testing.assert_close(normed.float(), want, rtol=2**-7, atol=1e-2)
        torch_bf16 = rms_norm(total, w, 1e-5).float()
        assert (normed.float() - want).abs().mean() <= (torch_bf16 - want).abs().mean()
        first, normed = add_rms_norm(x, None, w, 1e-5)
        assert first is x
        torch.testing.assert_close(
            normed.float(), rms_norm(x.float(), w.float(), 1e-5), rtol=2**-7, atol=1e-2
        )
        gate_up = torch.randn(rows, 2 * 48).to(bf)
        g, u = gate_up.float().chunk(2, dim=-1)
        got = silu_mul(gate_up)
        assert got.dtype == bf
        torch.testing.assert_close(got.float(), F.silu(g) * u, rtol=2**-7, atol=1e-2)
    # with autograd on, the PyTorch path runs (the C++ ops have no backward)
    xg = x.clone().requires_grad_()
    total, normed = add_rms_norm(xg, res, w, 1e-5)
    normed.sum().backward()
    assert xg.grad is not None


@pytest.mark.slow
@pytest.mark.main_pass_only  # a lock file's age, not the ISA
def test_a_stale_build_lock_does_not_hang_startup() -> None:
    """A process killed while compiling the C++ ops leaves torch's `lock` file behind; the next
    start must not wait on it forever (it did: a killed first start hung every later one). One
    op stands for all: they share CppOps.load, and each rebuild here is ~15 s of g++."""
    name = "kvserve_token_bitmask"
    import subprocess
    import sys
    from pathlib import Path

    ops = BY_NAME[name]
    assert ops.load() is not None  # built (or found) by this process
    lock = Path(ops.build_dir()) / "lock"
    complete = lock.parent / COMPLETE
    assert Path(lock.parent).name.startswith(name) and complete.is_file()
    complete.unlink()  # what a build killed mid-way leaves: torch's lock, no completion mark
    lock.write_text("")
    code = f"from kernels.ops import BY_NAME; assert BY_NAME[{name!r}].load() is not None"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, timeout=180, check=True)
    assert not lock.exists() and complete.is_file()


@pytest.mark.slow
@pytest.mark.main_pass_only  # where a library is found, not the ISA
def test_a_complete_build_loads_without_ninja() -> None:
    """A start that finds its library complete loads it as it is (running ninja to learn that
    it is up to date cost ~0.4 s an op in every process); other sources build elsewhere."""
    import subprocess
    import sys
    from pathlib import Path

    assert CPU_FUSED.load() is not None and CPU_FUSED.is_built()
    root = Path(__file__).resolve().parent.parent
    code = (
        "import torch.utils.cpp_extension as ext\n"
        "def refuse(*a, **k): raise AssertionError('ninja ran')\n"
        "ext.load = refuse\n"
        "from kernels.ops import CPU_FUSED; assert CPU_FUSED.load() is not None"
    )
    subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60, check=True)
    edited = CppOps("kvserve_cpu_fused", CPU_FUSED.source, (Path(__file__),))
    assert edited.build_dir() != CPU_FUSED.build_dir() and not edited.is_built()


def test_packed_rows_are_measured_here_and_set_on_every_packed_layer() -> None:
    from models.linear.measure import PACKED_ROW_BUCKETS, measure_packed_rows

    stack = torch.nn.Sequential(*(Linear(256, 512) for _ in range(4)))
    for layer in stack:
        layer.weight.data.normal_()
    if not pack_linears(stack):
        pytest.skip("oneDNN packs no float32 weight here")
    line = measure_packed_rows(stack)
    chosen = {layer.method.packed_min_rows for layer in stack}
    assert len(chosen) == 1
    (rows,) = chosen
    assert rows in PACKED_ROW_BUCKETS or rows == PACKED_ROW_BUCKETS[-1] + 1
    assert line.startswith(f"oneDNN-packed from {rows} rows (ms plain/packed by rows 1: ")
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        torch.testing.assert_close(stack[0](x), stack[0].method.plain(x), rtol=1e-4, atol=1e-4)
    assert measure_packed_rows(torch.nn.Sequential(Linear(8, 8))) == ""  # nothing packed
