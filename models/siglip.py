"""The SigLIP vision tower (Gemma 3's image encoder): a ViT over non-overlapping square patches
with learned absolute positions, pre-norm LayerNorm blocks, full (bidirectional) attention and a
tanh-GELU MLP, a final LayerNorm. Parameter names are the checkpoint's under `vision_tower.`,
so a tower loads its own tensors as stored. No pooling head: Gemma 3 reads the last hidden
state."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import ACTIVATIONS, PlainMLP


@dataclass(frozen=True, slots=True)
class SiglipSpec:
    """A tower's geometry, from a checkpoint's `vision_config`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @staticmethod
    def of(cfg: dict) -> SiglipSpec:
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"vision tower activation {act!r} is not supported")
        return SiglipSpec(
            cfg["hidden_size"],
            cfg["intermediate_size"],
            cfg["num_hidden_layers"],
            cfg["num_attention_heads"],
            cfg["image_size"],
            cfg["patch_size"],
            cfg.get("num_channels", 3),
            cfg.get("layer_norm_eps", 1e-6),
            act,
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class _Embeddings(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            spec.num_channels, spec.hidden_size, spec.patch_size, stride=spec.patch_size
        )
        self.position_embedding = nn.Embedding(spec.patches_per_side**2, spec.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        h = spec.hidden_size
        self.num_heads = spec.num_heads
        self.q_proj, self.k_proj = nn.Linear(h, h), nn.Linear(h, h)
        self.v_proj, self.out_proj = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, t, self.num_heads, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        )
        return self.out_proj(o.transpose(1, 2).reshape(n, t, h))


class _Layer(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = _Attention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = PlainMLP(spec.hidden_size, spec.intermediate_size, spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))


class SiglipVisionTower(nn.Module):
    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = _Embeddings(spec)
        self.encoder = _Encoder(spec)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, channels, size, size] -> last hidden state [images, patches, hidden]."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
