"""Small numeric building blocks shared by the architectures: RMSNorm (fused with the residual
add where kvserve's C++ ops serve), gated and plain activations, the vision towers' plain MLP
and rotary embeddings. The linear layer and its weight formats are models/linear/."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ops import CPU_FUSED

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
# the plain (ungated) ones, by a config's `hidden_act`: the vision towers' MLPs
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class PlainMLP(nn.Module):
    """second(act(first(x))), ungated: the vision towers' MLP. `names`: the checkpoint's names
    of the two linears (SigLIP's fc1 / fc2, Qwen3-VL's linear_fc1 / linear_fc2)."""

    def __init__(
        self, hidden: int, inner: int, act: str, names: tuple[str, str] = ("fc1", "fc2")
    ) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(hidden, inner))
        setattr(self, names[1], nn.Linear(inner, hidden))
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (getattr(self, name) for name in self.names)
        return second(self.act(first(x)))


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
    linear, YaRN and LongRoPE scaling (as transformers' `modeling_rope_utils` computes them).
    GGUF files carry Llama-3 and LongRoPE scaling as per-frequency divisors instead
    (`freq_factors`)."""
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
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling).float()
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


def _yarn(inv_freq: torch.Tensor, dims: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those that turn more than `beta_fast` times kept, a
    linear ramp between (over the dimension indices, floored/ceiled unless `truncate` is off)."""
    factor, old_ctx = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        return dims * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    ramp = (torch.arange(dims // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)
    ramp = ramp.clamp(0, 1)  # 0: kept (extrapolated), 1: interpolated
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """The magnitude correction of cos and sin: LongRoPE's, YaRN's (`attention_factor`, else
    0.1 ln(factor) + 1, or its ratio under `mscale` / `mscale_all_dim`); 1 for the others."""
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind not in ("longrope", "su", "yarn"):
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "yarn":
        factor = float(scaling["factor"])

        def mscale(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
        return mscale()
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
