"""Qwen2.5-VL's image path (`Qwen2_5_VLForConditionalGeneration`'s `visual`): a ViT at the
image's own resolution. The processor's patches (each temporal x patch x patch x 3 pixels,
flattened) go through a linear patch embedding (the checkpoint's Conv3d, whose kernel equals
its stride), 2-D rotary positions (height and width, each on a quarter of a head), blocks of
RMSNorm + attention + RMSNorm + SwiGLU in which the `fullatt_block_indexes` attend over the
whole image and the others within windows of `window_size` pixels; then the patch merger:
RMSNorm, each `spatial_merge_size`^2 neighbouring patches concatenated, a GELU MLP into the text
model's width. One soft token per merged patch (models/image_processor.py's patch order is
merge-block-major, so neighbours are adjacent rows). Parameter names are the checkpoint's
under `visual.`. The attention, block, patch embedding and rotary serve Qwen3-VL's tower too
(models/qwen3_vision.py)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.layers import ACTIVATIONS, RMSNorm, apply_rope
from models.spec import VisionSpec

_PREFIXES = ("visual.", "model.visual.")  # transformers 5's own spelling, and the original


def is_qwen_vision_tensor(name: str) -> bool:
    return name.startswith(_PREFIXES)


@dataclass(frozen=True, slots=True)
class QwenVisionSpec:
    """A Qwen tower's geometry, from a checkpoint's `vision_config`: Qwen2.5-VL's windows
    (`window_size`, `fullatt_block_indexes`) or Qwen3-VL's learned position grid
    (`num_position_embeddings`) and deepstack layers (`deepstack_visual_indexes`)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    in_channels: int = 3
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @staticmethod
    def of(cfg: dict) -> QwenVisionSpec:
        act = cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"Qwen vision activation {act!r} is not supported")
        rope = cfg.get("rope_parameters") or {}
        return QwenVisionSpec(
            cfg["depth"],
            cfg["hidden_size"],
            cfg["intermediate_size"],
            cfg["num_heads"],
            cfg["out_hidden_size"],
            cfg["patch_size"],
            cfg.get("spatial_merge_size", 2),
            cfg.get("temporal_patch_size", 2),
            cfg.get("window_size", 0),
            tuple(cfg.get("fullatt_block_indexes") or ()),
            cfg.get("in_channels", 3),
            float(rope.get("rope_theta", 10000.0)),
            act,
            cfg.get("num_position_embeddings", 0),
            tuple(cfg.get("deepstack_visual_indexes") or ()),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[np.ndarray, list]:
    """The merged patches of one image in window order (each window of `window` merged patches
    a side, row-major within, windows row-major per frame; edge windows smaller), and each
    window's length in patches (as transformers' `get_vision_window_index`)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    index = np.arange(t * h * w).reshape(t, h, w)
    order, lengths = [], []
    for frame in index:
        for r in range(0, h, window):
            for c in range(0, w, window):
                cell = frame[r : r + window, c : c + window].ravel()
                order.append(cell)
                lengths.append(cell.size * merge * merge)
    return np.concatenate(order), lengths


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of the rows ([rows, heads, dim]),
    segments of one length batched into one SDPA call."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, n in zip(starts.tolist(), lengths):
        by_length[n].append(start)
    out = torch.empty_like(q)
    heads, dim = q.shape[1:]
    for n, firsts in by_length.items():
        rows = (torch.tensor(firsts)[:, None] + torch.arange(n)).reshape(-1).to(q.device)
        q_, k_, v_ = (x[rows].view(len(firsts), n, heads, dim).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q_, k_, v_)
        out[rows] = o.transpose(1, 2).reshape(-1, heads, dim)
    return out


class VisionAttention(nn.Module):
    """Bidirectional attention within segments of the rows, q and k rotated (2-D rotary)."""

    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        o = segment_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, lengths)
        return self.proj(o.reshape(x.shape))


class _MLP(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, i), nn.Linear(h, i)
        self.down_proj = nn.Linear(i, h)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm attention then MLP, each added to the residual; `norm` makes the two norms
    (RMSNorm in Qwen2.5-VL, LayerNorm in Qwen3-VL), `mlp` is the block's MLP."""

    def __init__(
        self, spec: QwenVisionSpec, norm: Callable[[int], nn.Module], mlp: nn.Module
    ) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(spec.hidden_size), norm(spec.hidden_size)
        self.attn = VisionAttention(spec)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d patch embedding (its kernel equals its stride), applied as the
    linear it is; Qwen3-VL's has a bias."""

    def __init__(self, spec: QwenVisionSpec, bias: bool = False) -> None:
        super().__init__()
        p, t = spec.patch_size, spec.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(
            torch.empty(spec.hidden_size, spec.in_channels, t, p, p), requires_grad=False
        )
        self.proj.bias = nn.Parameter(torch.zeros(spec.hidden_size), False) if bias else None

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(
            patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias
        )


def rotary_inv_freq(spec: QwenVisionSpec) -> torch.Tensor:
    """float32 inverse frequencies of the 2-D rotary: height and width each a quarter of a
    head (on the CPU whatever the serving device and dtype: not a buffer)."""
    quarter = spec.head_dim // 2
    with torch.device("cpu"):
        return 1.0 / spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)


def patch_rotary(
    grid: tuple[int, int, int], merge: int, inv_freq: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [patches, 1, head_dim / 2]: each patch's height and width positions, each on a
    quarter of the head, in the processor's merge-block-major patch order."""
    t, h, w = grid
    hpos = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge)
    wpos = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge)
    hw = torch.stack([hpos.transpose(1, 2).reshape(-1), wpos.transpose(1, 2).reshape(-1)], -1)
    hw = hw.repeat(t, 1).to(device)
    freqs = (hw[..., None].float() * inv_freq.to(device)).reshape(hw.shape[0], -1)
    return freqs.cos()[:, None, :], freqs.sin()[:, None, :]


class _Merger(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        width = spec.hidden_size * spec.spatial_merge_size**2
        self.ln_q = RMSNorm(spec.hidden_size, 1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, spec.out_hidden_size)
        )
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(nn.Module):
    """Qwen2.5-VL's tower."""

    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        rms = partial(RMSNorm, eps=1e-6)
        self.blocks = nn.ModuleList(VisionBlock(spec, rms, _MLP(spec)) for _ in range(spec.depth))
        self.merger = _Merger(spec)
        self.inv_freq = rotary_inv_freq(spec)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, channels*temporal*patch^2] in the processor's order ->
        soft tokens [t*h*w / merge^2, out_hidden]."""
        s, unit = self.spec, self.spec.spatial_merge_size**2
        order, window_lengths = window_order(
            grid, s.spatial_merge_size, s.window_size // s.spatial_merge_size // s.patch_size
        )
        order_t = torch.from_numpy(order).to(patches.device)
        # rows in window order, a merged patch's `unit` rows kept together
        rows = (order_t[:, None] * unit + torch.arange(unit, device=patches.device)).reshape(-1)
        x = self.patch_embed(patches)[rows]
        cos, sin = patch_rotary(grid, s.spatial_merge_size, self.inv_freq, patches.device)
        cos, sin = cos[rows], sin[rows]
        frame = grid[1] * grid[2]
        full_lengths = [frame] * grid[0]
        for i, block in enumerate(self.blocks):
            lengths = full_lengths if i in s.fullatt_block_indexes else window_lengths
            x = block(x, cos, sin, lengths)
        merged = self.merger(x)
        return merged[torch.argsort(order_t)]


class QwenImageEncoder(nn.Module):
    """Each image's patches and grid -> its soft tokens in the text model's width (and after
    them, along the width, what its tower adds to decoder layers: Qwen3-VL's deepstack)."""

    def __init__(
        self,
        vision: VisionSpec,
        text_hidden: int,
        tower: Callable[[QwenVisionSpec], nn.Module] = QwenVisionTower,
    ) -> None:
        super().__init__()
        spec = QwenVisionSpec.of(vision.tower_config)
        if spec.out_hidden_size != text_hidden:
            raise ValueError(
                f"the vision merger's width {spec.out_hidden_size} is not the text "
                f"model's {text_hidden}"
            )
        self.visual = tower(spec)

    @torch.inference_mode()
    def encode(
        self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int] | None]
    ) -> list[torch.Tensor]:
        """Images are independent in the tower (no attention across them): one at a time."""
        out = []
        for patches, grid in zip(pixels, grids, strict=True):
            assert grid is not None, "a Qwen image carries its patch grid"
            out.append(self.visual(patches, grid))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = {}
        for name, tensor in weights:
            if name.startswith("model.visual."):
                name = name[len("model.") :]
            if name.startswith("visual."):
                state[name] = tensor
        self.load_state_dict(state, strict=True)
