"""Block-quantized FP8 checkpoints (`quantization_config: {quant_method: "fp8", ...}`, what
transformers' FineGrainedFP8 integration reads: DeepSeek's releases), served dequantized.

Each quantized `X.weight` is float8_e4m3fn with a `X.weight_scale_inv` beside it (`X.scale` in
DeepSeek's own files, as transformers renames it): one scale per
`weight_block_size` block (128x128), the edge blocks partial (the grid is the ceiling of the
weight's shape over the block). The scales are float32 (`scale_fmt: "float"`) or powers of two
(`"ue8m0"`, float8_e8m0fnu). DeepSeek V4's routed experts may instead be FP4 (`expert_dtype:
"fp4"`): two e2m1 values a byte (low nibble first), one scale per 32 values of a row.

kvserve has no FP8 or FP4 matmul: every such weight is multiplied out to the serving dtype as it
is read (the banner's weights line says so, and what it costs: `dequantized_note`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SCALE_SUFFIX = "_scale_inv"
# e2m1's sixteen values, by their 4-bit code (sign in the top bit)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_BLOCK = (1, 32)
_PACKED_FP4 = {torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", torch.int8)}


@dataclass(frozen=True, slots=True)
class FP8Format:
    block: tuple[int, int]  # rows x columns one FP8 scale covers
    scale_fmt: str  # "float" or "ue8m0"
    expert_dtype: str  # "fp8" or "fp4"

    def describe(self) -> str:
        experts = "; FP4 (e2m1) routed experts, 1x32 blocks" if self.expert_dtype == "fp4" else ""
        return (
            f"FP8 e4m3 weights in {self.block[0]}x{self.block[1]} blocks ({self.scale_fmt} "
            f"scales){experts}"
        )


def fp8_format(cfg: dict) -> FP8Format | None:
    """The config's FP8 block format; None for an unquantized checkpoint; ValueError, with the
    reason, for another quantization method or an FP8 variant kvserve cannot dequantize."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method", "?")
    if method != "fp8":
        raise ValueError(
            f"{method} quantized weights are not supported (FP8 block-quantized "
            "checkpoints are served dequantized; else serve bf16 or float32)"
        )
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            "FP8 with static activation scales is not supported (kvserve serves "
            "FP8 weights dequantized, activations unquantized)"
        )
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(
            "FP8 weights without a weight_block_size (per-tensor scales) are not "
            "supported: block-quantized (e.g. 128x128) only"
        )
    scale_fmt = q.get("scale_fmt", "float")
    experts = q.get("expert_dtype", cfg.get("expert_dtype", "fp8"))
    if scale_fmt not in ("float", "ue8m0") or experts not in ("fp8", "fp4"):
        raise ValueError(
            f"FP8 scale_fmt {scale_fmt!r} / expert_dtype {experts!r} is not "
            "supported (float or ue8m0 scales; fp8 or fp4 experts)"
        )
    return FP8Format((int(block[0]), int(block[1])), scale_fmt, experts)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 values a byte (low nibble first) -> float32, twice as wide on the last dim."""
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)
    both = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1)
    return both.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize(
    name: str, weight: torch.Tensor, scale: torch.Tensor, fmt: FP8Format
) -> torch.Tensor:
    """`weight` [..., rows, cols] (FP8, or packed FP4) times its per-block scales, in float32."""
    if weight.dtype == torch.float8_e4m3fn:
        values, (br, bc) = weight.float(), fmt.block
    elif weight.dtype in _PACKED_FP4:
        values, (br, bc) = unpack_fp4(weight), _FP4_BLOCK
    else:
        raise ValueError(f"{name}: a scale beside a {weight.dtype} weight (FP8 e4m3 or FP4)")
    rows, cols = values.shape[-2:]
    grid = (-(-rows // br), -(-cols // bc))
    if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != values.shape[:-2]:
        raise ValueError(
            f"{name}: scales {list(scale.shape)} for a {rows}x{cols} weight in "
            f"{br}x{bc} blocks (expected a {grid[0]}x{grid[1]} grid)"
        )
    s = scale.float()  # float32, bf16 or e8m0 (a power of two) scales alike
    s = s.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    return values * s


def _weight_of(scale_name: str) -> str | None:
    """The weight a scale tensor belongs to: `X.weight_scale_inv` (transformers' name) or
    `X.scale` (DeepSeek's own files: V4-Flash) -> `X.weight`; None for any other tensor."""
    if scale_name.endswith(".weight" + SCALE_SUFFIX):
        return scale_name[: -len(SCALE_SUFFIX)]
    if scale_name.endswith(".scale"):
        return scale_name[: -len(".scale")] + ".weight"
    return None


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], fmt: FP8Format, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (as stored) in `dtype`, each quantized weight dequantized once
    its scale has arrived (they may sit in different files, in either order)."""
    quantized = {torch.float8_e4m3fn} | (_PACKED_FP4 if fmt.expert_dtype == "fp4" else set())
    pairs: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> what arrived of its pair
    for name, t in weights:
        weight_name = _weight_of(name)
        if weight_name is None and t.dtype not in quantized:
            yield name, t.to(dtype)
            continue
        pair = pairs.setdefault(weight_name or name, {})
        pair["scale" if weight_name else "weight"] = t
        if len(pair) == 2:
            del pairs[weight_name or name]
            key = weight_name or name
            yield key, dequantize(key, pair["weight"], pair["scale"], fmt).to(dtype)
    if pairs:
        raise ValueError(f"quantized weights or scales without their pair: {sorted(pairs)[:4]}")


def dequantized_note(path: str, served: torch.nn.Module) -> str | None:
    """The banner's words for an FP8 checkpoint served dequantized: its format and the memory
    the dequantized weights take against the files' (None for any other checkpoint)."""
    root = Path(path)
    if not (root / "config.json").is_file():
        return None
    fmt = fp8_format(json.loads((root / "config.json").read_text()))
    if fmt is None:
        return None
    stored = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    tensors = {id(t): t for t in [*served.parameters(), *served.buffers()]}.values()
    held = sum(t.numel() * t.element_size() for t in tensors)
    return (
        f"{fmt.describe()} served dequantized: {held / 2**30:.3g} GiB of weights in memory "
        f"against {stored / 2**30:.3g} GiB of files ({held / max(stored, 1):.2f}x)"
    )
