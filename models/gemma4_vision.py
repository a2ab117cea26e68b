"""Gemma 4's image path (`Gemma4ForConditionalGeneration`): its own vision tower and the
multimodal embedder into the text model, as transformers' `Gemma4VisionModel` and
`Gemma4MultimodalEmbedder` compute them. An image's patches (models/gemma4_image_processor.py)
are projected from [-1, 1] pixels, given learned x and y position embeddings, and read by
encoder layers with full attention among the image's patches, 2-D rotary positions (the first
half of a head turned by the patch's column, the second by its row), q/k RMSNorms, an unscaled
value norm and no 1/sqrt(d) score scale; each kernel x kernel block of patches is then averaged
into one soft token, scaled by sqrt(width) (optionally standardised), RMS-normed without a
scale and projected into the text model's width. The text model is Gemma 4's (models/gemma4.py);
its image placeholders hold the soft tokens, unscaled, and their per-layer inputs are the pad
token's. An image's soft tokens attend both ways on the sliding-window layers only, where the
text config says "vision"; causally otherwise. The audio tower is not loaded (audio inputs
are not accepted)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import ACTIVATIONS, RMSNorm, rms_norm
from models.spec import VisionSpec

_PREFIXES = ("vision_tower.", "embed_vision.")
_NESTED = "model."


def gemma4_vision_spec(cfg: dict) -> VisionSpec | None:
    """The image side of a Gemma 4 ConditionalGeneration config (None: it has no tower).
    Its images attend causally, unless the text config's `use_bidirectional_attention` is
    "vision": then an image's tokens attend both ways on the sliding-window layers only, as
    transformers' mask for them does ("all", a text model attending both ways everywhere, is
    refused)."""
    tower = cfg.get("vision_config")
    if not tower:
        return None
    two_way = (cfg.get("text_config") or {}).get("use_bidirectional_attention")
    if two_way not in (None, "vision"):
        raise ValueError(
            f"Gemma 4 with use_bidirectional_attention={two_way!r} is not supported (a text "
            "model attending both ways is not a causal decoder)"
        )
    rope = tower.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"Gemma 4 vision rope {rope.get('rope_type')!r} is not supported")
    return VisionSpec(
        architecture="gemma4",
        image_token_id=int(cfg.get("image_token_id", 258_880)),
        tokens_per_image=0,
        begin_token_id=cfg.get("boi_token_id", 255_999),
        end_token_id=cfg.get("eoi_token_id", 258_882),
        tower_config=dict(tower),
        spatial_merge=int(tower.get("pooling_kernel_size", 3)),
        two_way=two_way == "vision",
        marker="wrapped",
        two_way_windowed_only=True,
    )


def is_gemma4_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the image path (its tower or embedder)."""
    name = name[len(_NESTED) :] if name.startswith(_NESTED) else name
    return name.startswith(_PREFIXES)


@dataclass(frozen=True, slots=True)
class _TowerSpec:
    hidden: int
    inner: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    act: str
    eps: float
    patch: int
    positions: int
    kernel: int
    theta: float
    clipped: bool
    standardize: bool

    @staticmethod
    def of(cfg: dict) -> _TowerSpec:
        heads = int(cfg.get("num_attention_heads", 12))
        return _TowerSpec(
            int(cfg.get("hidden_size", 768)),
            int(cfg.get("intermediate_size", 3072)),
            int(cfg.get("num_hidden_layers", 16)),
            heads,
            int(cfg.get("num_key_value_heads", heads)),
            int(cfg.get("head_dim", 64)),
            cfg.get("hidden_activation", "gelu_pytorch_tanh"),
            float(cfg.get("rms_norm_eps", 1e-6)),
            int(cfg.get("patch_size", 16)),
            int(cfg.get("position_embedding_size", 10 * 1024)),
            int(cfg.get("pooling_kernel_size", 3)),
            float((cfg.get("rope_parameters") or {}).get("rope_theta", 100.0)),
            bool(cfg.get("use_clipped_linears", False)),
            bool(cfg.get("standardize", False)),
        )


class _ClippableLinear(nn.Module):
    """A bias-free linear whose input and output may be clamped to the checkpoint's bounds."""

    def __init__(self, fan_in: int, fan_out: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        self.clipped = clipped
        if clipped:
            for bound in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(bound, torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class _Attention(nn.Module):
    def __init__(self, s: _TowerSpec) -> None:
        super().__init__()
        self.s = s
        self.q_proj = _ClippableLinear(s.hidden, s.heads * s.head_dim, s.clipped)
        self.k_proj = _ClippableLinear(s.hidden, s.kv_heads * s.head_dim, s.clipped)
        self.v_proj = _ClippableLinear(s.hidden, s.kv_heads * s.head_dim, s.clipped)
        self.o_proj = _ClippableLinear(s.heads * s.head_dim, s.hidden, s.clipped)
        self.q_norm = RMSNorm(s.head_dim, s.eps)
        self.k_norm = RMSNorm(s.head_dim, s.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x` [patches, hidden] of one image; cos/sin [patches, head_dim]."""
        n, s = x.shape[0], self.s
        half = s.head_dim // 2

        def turned(t: torch.Tensor) -> torch.Tensor:  # the column half, then the row half
            return torch.cat(
                [_rotate(p, c, z) for p, c, z in zip(t.split(half, -1), cos, sin, strict=True)],
                dim=-1,
            )

        q = turned(self.q_norm(self.q_proj(x).view(n, s.heads, s.head_dim)))
        k = turned(self.k_norm(self.k_proj(x).view(n, s.kv_heads, s.head_dim)))
        v = rms_norm(self.v_proj(x).view(n, s.kv_heads, s.head_dim), None, s.eps)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if s.kv_heads != s.heads:
            k = k.repeat_interleave(s.heads // s.kv_heads, dim=0)
            v = v.repeat_interleave(s.heads // s.kv_heads, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, s: _TowerSpec) -> None:
        super().__init__()
        self.gate_proj = _ClippableLinear(s.hidden, s.inner, s.clipped)
        self.up_proj = _ClippableLinear(s.hidden, s.inner, s.clipped)
        self.down_proj = _ClippableLinear(s.inner, s.hidden, s.clipped)
        self.act = ACTIVATIONS[s.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, s: _TowerSpec) -> None:
        super().__init__()
        self.self_attn = _Attention(s)
        self.mlp = _MLP(s)
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.pre_feedforward_layernorm = RMSNorm(s.hidden, s.eps)
        self.post_feedforward_layernorm = RMSNorm(s.hidden, s.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _PatchEmbedder(nn.Module):
    def __init__(self, s: _TowerSpec) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * s.patch**2, s.hidden, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, s.positions, s.hidden), requires_grad=False
        )

    def forward(self, patches: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        table = self.position_embedding_table
        return self.input_proj(2 * (patches - 0.5)) + table[0][xy[:, 0]] + table[1][xy[:, 1]]


class _Encoder(nn.Module):
    def __init__(self, s: _TowerSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.layers))


class _Tower(nn.Module):
    def __init__(self, s: _TowerSpec) -> None:
        super().__init__()
        self.s = s
        self.patch_embedder = _PatchEmbedder(s)
        self.encoder = _Encoder(s)
        if s.standardize:
            self.register_buffer("std_bias", torch.empty(s.hidden))
            self.register_buffer("std_scale", torch.empty(s.hidden))
        spatial = s.head_dim // 2
        inv = 1.0 / (s.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Patches [h * w, 3 * patch^2] of one image (grid (1, h, w)) -> pooled features
        [h * w / kernel^2, hidden] in float32."""
        _, gh, gw = grid
        k = self.s.kernel
        ys, xs = torch.meshgrid(
            torch.arange(gh, device=patches.device),
            torch.arange(gw, device=patches.device),
            indexing="ij",
        )
        xy = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
        x = self.patch_embedder(patches, xy)
        angles = xy[..., None].float() * self.inv_freq  # [patches, 2, head_dim / 4]
        angles = torch.cat([angles, angles], dim=-1)
        # per half [patches, 1, head_dim / 2], broadcast over the heads
        cos = tuple(angles.cos().to(x.dtype).unsqueeze(1).unbind(2))
        sin = tuple(angles.sin().to(x.dtype).unsqueeze(1).unbind(2))
        for layer in self.encoder.layers:
            x = layer(x, cos, sin)
        # each kernel x kernel block of patches averaged, row-major over the pooled grid
        pooled = x.float().view(gh // k, k, gw // k, k, -1).mean(dim=(1, 3)).flatten(0, 1)
        pooled = pooled * self.s.hidden**0.5
        if self.s.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


class _Embedder(nn.Module):
    def __init__(self, width: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(width, text_hidden, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_norm(x, None, self.eps))


class Gemma4ImageEncoder(nn.Module):
    """Patches of each image -> its soft tokens [h * w / kernel^2, text hidden]."""

    def __init__(self, vision: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        s = _TowerSpec.of(vision.tower_config)
        self.vision_tower = _Tower(s)
        self.embed_vision = _Embedder(s.hidden, text_hidden, s.eps)

    @torch.inference_mode()
    def encode(
        self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int] | None]
    ) -> list[torch.Tensor]:
        """One image at a time (each has its own patch grid)."""
        return [self._soft_tokens(p, g) for p, g in zip(pixels, grids, strict=True)]

    def _soft_tokens(
        self, patches: torch.Tensor, grid: tuple[int, int, int] | None
    ) -> torch.Tensor:
        assert grid is not None, "a Gemma 4 image has a patch grid"
        return self.embed_vision(self.vision_tower(patches, grid).to(patches.dtype))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The image path's tensors of a checkpoint (others, the audio tower's among them, are
        skipped); raises on a missing one."""
        state = {}
        for name, tensor in weights:
            name = name[len(_NESTED) :] if name.startswith(_NESTED) else name
            if name.startswith(_PREFIXES):
                state[name] = tensor
        self.load_state_dict(state, strict=True)
