"""Small numeric building blocks shared by the architectures: RMSNorm, rotary embeddings, and a
linear layer tuned for CPU matmuls.

Why `Linear` computes `(W @ x.T).T` on CPU: with W stored [out, in] (HF layout) MKL runs that as a
GEMM with a skinny right-hand side, which reads weights at close to memory bandwidth for 2-16 rows,
while `x @ W.T` / `F.linear` at 2-16 rows runs 2-3x slower and a single row goes down MKL's
GEMV path at half the bandwidth. One row is therefore padded to two. Measured over SmolLM2's 30
layers of weights (424 MB, out of cache) here: 1 row 27.5 ms (x @ W_t, the old layout) -> 14.8 ms;
5 rows 41 -> 24 ms; 64 rows 119 -> 93 ms; 1024 rows equal (`docs/spikes/matmul_layouts.py`). On CUDA
`F.linear` is one cuBLAS call and is used as is.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import CPU_FUSED


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias) -> [rows, out], the fastest form on CPU."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        # bf16 (unpacked only with --no-cpu-packed-weights): the (W @ x.T).T form is MKL's
        # float32 trick; oneDNN's bf16 F.linear measured as fast at 2-64 rows, faster at one
        return F.linear(x, weight, bias)
    # MKL's fast path wants x row-major (so x.t() is a transposed view) and at least two rows.
    rows = x.shape[0]
    xt = (x.contiguous() if rows > 1 else x.expand(2, -1).contiguous()).t()
    if bias is None:
        out = torch.mm(weight, xt)
    else:
        out = torch.addmm(bias[:, None], weight, xt)
    return out.t() if rows > 1 else out[:, :1].t()


# From this many rows a oneDNN-packed weight beats the unpacked path, until `measure_packed_rows`
# measures it on the CPU at hand (the engine does at startup). These defaults are a Zen 5's:
# float32 from 3 rows (MKL's skinny GEMM won below), bfloat16 from one row; a Sapphire Rapids
# measured float32 packed 2x faster at one row.
PACKED_MIN_ROWS = {torch.float32: 3, torch.bfloat16: 1}


@functools.cache
def onednn_pack_refusal(dtype: torch.dtype) -> str | None:
    """None when oneDNN packs and multiplies a `dtype` weight here, else its reason.

    Asked of oneDNN with a tiny weight, never read from the dtype or CPU flags: its bf16 reorder
    needs AVX512BW/VL/DQ or AVX-NE-CONVERT and raises on an AVX2-only CPU (Zen 3), and
    `ONEDNN_MAX_CPU_ISA` lowers what it will use below what the CPU has."""
    if dtype not in PACKED_MIN_ROWS:
        return f"oneDNN-packed weights are float32/bfloat16 only, not {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    w, x = torch.ones(16, 16, dtype=dtype), torch.ones(2, 16, dtype=dtype)
    try:
        with torch.inference_mode():
            y = onednn_linear(x, onednn_pack(w), None)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    if not torch.equal(y.float(), torch.full((2, 16), 16.0)):
        return "oneDNN's packed matmul gave a wrong product in the startup check"
    return None


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and onednn_pack_refusal(weight.dtype) is None


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout (the batch-size hint picks the blocking;
    64 measured best for 4-256 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ a weight packed by `onednn_pack` (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # A oneDNN blocked copy of `weight` (CPU float32 or bfloat16; see `pack`), or None.
        self.packed: torch.Tensor | None = None
        self.packed_min_rows = 0
        # the weight in another format, which multiplies x itself: int8 W8A8 (models/quant.py,
        # --quantization int8) or a GGUF file's blocks (models/gguf_linear.py); then `weight`
        # is empty
        self.quant: Callable[[torch.Tensor], torch.Tensor] | None = None

    def pack(self) -> int:
        """Also hold the weight in oneDNN's blocked layout for matmuls of >= PACKED_MIN_ROWS
        rows. Call after the weights are final (a later weight change is not seen). Returns
        the bytes added."""
        if self.quant is not None:  # a GGUF weight packs its own dense copy; int8 has none
            pack = getattr(self.quant, "pack", None)
            return pack() if pack is not None else 0
        if not can_pack(self.weight):
            return 0
        self.packed = onednn_pack(self.weight.detach())
        self.packed_min_rows = PACKED_MIN_ROWS[self.weight.dtype]
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x)
        packed = self.packed is not None and x.dim() == 2 and x.shape[0] >= self.packed_min_rows
        if packed and x.dtype == self.weight.dtype:
            return self.packed_forward(x)
        return self.plain_forward(x)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)

    def plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias)

    def rows(self, index: slice | torch.Tensor) -> Linear:
        """A Linear over output rows `index` of this one (a slice: views of its weight or a GGUF
        weight's blocks; row ids: copies), packed again if this one is."""
        part = Linear(self.in_features, 0, bias=self.bias is not None)
        if self.bias is not None:
            part.bias = nn.Parameter(self.bias.detach()[index], requires_grad=False)
        if self.quant is not None:
            part.quant = self.quant.rows(index)  # type: ignore[attr-defined]
            return part
        part.weight = nn.Parameter(self.weight.detach()[index], requires_grad=False)
        if self.packed is not None:
            part.pack()
            part.packed_min_rows = self.packed_min_rows
        return part

    def load_rows(self, start: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy an HF-layout weight [out_rows, in] into output rows [start, start + out_rows)."""
        rows = weight.shape[0]
        self.weight.data[start : start + rows].copy_(weight)
        if bias is not None:
            assert self.bias is not None
            self.bias.data[start : start + rows].copy_(bias)


def pack_linears(module: nn.Module) -> int:
    """`Linear.pack` every linear layer under `module` (each weight once, tied ones too)."""
    return sum(m.pack() for m in module.modules() if isinstance(m, Linear))


def best_pass_time(calls: list[tuple[Callable, torch.Tensor]], repeats: int = 3) -> float:
    """Best time of one pass through `calls` (fn, x) in order: a forward's stream of weights,
    mostly out of cache. The first pass allocates and warms the kernels, and is not counted."""
    return best_pass_times([calls], repeats)[0]


def best_pass_times(
    passes: list[list[tuple[Callable, torch.Tensor]]], repeats: int = 3
) -> list[float]:
    """`best_pass_time` of each of `passes` (the paths a crossover compares), timed in
    interleaved rounds so that load on a shared machine lands on every path alike rather
    than on whichever ran while a neighbour was busy."""
    best = [float("inf")] * len(passes)
    for i in range(repeats + 1):
        for j, calls in enumerate(passes):
            start = time.perf_counter()
            for fn, x in calls:
                fn(x)
            if i:
                best[j] = min(best[j], time.perf_counter() - start)
    return best


PACKED_ROW_BUCKETS = (1, 2, 3, 4, 8)


@torch.inference_mode()
def measure_packed_rows(module: nn.Module) -> str:
    """From how many rows the oneDNN-packed copies beat the plain matmul, measured here over all
    packed linear layers under `module` in forward order (PACKED_MIN_ROWS was measured on a
    Zen 5): the first of PACKED_ROW_BUCKETS where the packed pass is as fast, set on every packed
    layer. Returns the choice and times for the banner ("" when nothing is packed)."""
    layers = [m for m in module.modules() if isinstance(m, Linear) and m.packed is not None]
    if not layers:
        return ""
    seen, chosen = [], PACKED_ROW_BUCKETS[-1] + 1
    for rows in PACKED_ROW_BUCKETS:
        xs = {m.in_features: torch.randn(rows, m.in_features).to(m.weight.dtype) for m in layers}
        plain, packed = best_pass_times([
            [(m.plain_forward, xs[m.in_features]) for m in layers],
            [(m.packed_forward, xs[m.in_features]) for m in layers],
        ])  # fmt: skip
        seen.append(f"{rows}: {plain * 1e3:.1f}/{packed * 1e3:.1f}")
        if packed <= plain:
            chosen = rows
            break
    for m in layers:
        m.packed_min_rows = chosen
    return f"oneDNN-packed from {chosen} rows (ms plain/packed by rows {', '.join(seen)})"


_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _fused_ops(x: torch.Tensor):  # -> the compiled ops, or None
    """kvserve's C++ ops where they apply: CPU float32 or bfloat16 (computed in float32), no
    autograd (they have no backward)."""
    if x.device.type != "cpu" or x.dtype not in _FUSED_DTYPES or x.dim() != 2:
        return None
    if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        return None
    return CPU_FUSED.load()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm(residual + x)); with residual None, (x, RMSNorm(x))."""
    ops = _fused_ops(x)
    same = weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    if ops is not None and same:
        res = residual.contiguous() if residual is not None else None
        return ops.add_rms_norm(x.contiguous(), res, weight, eps)
    total = x if residual is None else residual + x
    return total, rms_norm(total, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate ; up] along the last dim."""
    ops = _fused_ops(gate_up)
    if ops is not None:
        return ops.silu_mul(gate_up.contiguous())
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up: Gemma's GeGLU."""
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter], approximate="tanh") * gate_up[..., inter:]


GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; `weight` None: no scale (Gemma 4's value and router norms)."""
    if x.dtype == torch.float32:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return out if weight is None else out * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) if weight is None else weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for rotary embeddings over `head_dim` rotated dimensions, with Llama-3,
    linear and LongRoPE scaling. GGUF files carry Llama-3 and LongRoPE scaling as per-frequency
    divisors instead (`freq_factors`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and "freq_factors" in scaling:
        return (inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64)).float()
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("longrope", "su"):
        # Phi-3's long or short factors, chosen once for the served context (models/phi3.py)
        factors = scaling["long_factor" if scaling.get("use_long") else "short_factor"]
        return (inv_freq / torch.tensor(factors, dtype=torch.float64)).float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    if kind == "proportional":
        # Gemma 4's global layers: the first `partial_rotary_factor` of the frequencies, at
        # their full-head_dim values, rotate pairs (i, i + head_dim/2) across the whole head;
        # the others are zero (cos 1, sin 0: those dims pass unchanged, exactly)
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv_freq[angles:] = 0.0
        return (inv_freq / float(scaling.get("factor", 1.0))).float()
    if kind in (None, "default"):
        return inv_freq.float()
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def rope_attention_factor(scaling: dict | None) -> float:
    """LongRoPE's magnitude correction of cos and sin (1 for every other scaling)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor") or 1.0)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin of shape [tokens, 1, head_dim // 2], computed once per forward. Kept in
    float32 whatever the serving dtype: a bf16 table has 8 mantissa bits, so every rotation
    would be off by up to 0.4% before any arithmetic (worst at the long wavelengths that
    Llama-3 scaling and large thetas stretch)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (HF layout) on x of shape [tokens, heads, head_dim],
    computed in float32 (the tables' dtype) and returned in x's dtype. Tables narrower than
    head_dim / 2 rotate the leading dimensions only (partial rotary) and pass the rest."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
