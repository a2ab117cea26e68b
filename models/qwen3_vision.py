"""Qwen3-VL's image path (`Qwen3VLForConditionalGeneration`'s `visual`): Qwen2.5-VL's ViT
(models/qwen_vision.py: the Conv3d patch embedding, here with a bias, and the 2-D rotary) with
a learned position embedding too, a square table interpolated bilinearly (corners aligned) to
the image's patch grid; LayerNorm blocks with an ungated MLP, every block attending over the
whole image (no windows); the patch merger (LayerNorm on each patch, then the merge block's
patches concatenated into a GELU MLP). **Deepstack**: after each of `deepstack_visual_indexes`'
blocks a merger of its own (LayerNorm on the concatenated block) makes features that the
decoder adds to the image's hidden states after its first layers, one layer each
(models/llama.py). `encode` hands them back beside the soft tokens along the width,
[tokens, hidden * (1 + deepstack layers)], so the encoder cache keeps them with the image."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models.layers import PlainMLP
from models.qwen_vision import (
    PatchEmbed,
    QwenVisionSpec,
    VisionBlock,
    patch_rotary,
    rotary_inv_freq,
)


class _Merger(nn.Module):
    """Each merge block's patches concatenated, into the text model's width. `postshuffle`
    (the deepstack mergers): the LayerNorm on the concatenation, not on each patch."""

    def __init__(self, spec: QwenVisionSpec, postshuffle: bool) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else spec.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


class Qwen3VisionTower(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        if not spec.num_position_embeddings:
            raise ValueError("a Qwen3-VL vision config names no num_position_embeddings")
        if spec.window_size or spec.fullatt_block_indexes:
            raise ValueError("Qwen3-VL's tower has no attention windows")
        self.spec = spec
        self.side = int(spec.num_position_embeddings**0.5)
        if self.side**2 != spec.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings {spec.num_position_embeddings} is not a square grid"
            )
        self.patch_embed = PatchEmbed(spec, bias=True)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.blocks = nn.ModuleList(
            VisionBlock(
                spec,
                norm,
                PlainMLP(
                    spec.hidden_size,
                    spec.intermediate_size,
                    spec.hidden_act,
                    ("linear_fc1", "linear_fc2"),
                ),
            )
            for _ in range(spec.depth)
        )
        self.merger = _Merger(spec, postshuffle=False)
        if any(not 0 <= i < spec.depth for i in spec.deepstack_visual_indexes):
            raise ValueError(
                f"deepstack_visual_indexes {list(spec.deepstack_visual_indexes)} "
                f"name blocks outside the tower's {spec.depth}"
            )
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(spec, postshuffle=True) for _ in spec.deepstack_visual_indexes
        )
        self.inv_freq = rotary_inv_freq(spec)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, channels*temporal*patch^2] in the processor's order ->
        [t*h*w / merge^2, out_hidden * (1 + deepstack layers)]: the soft tokens, then each
        deepstack layer's features, in the order of their blocks."""
        s, (t, h, w) = self.spec, grid
        x = self.patch_embed(patches)
        x = x + self._positions(h, w).to(x.dtype).repeat(t, 1)
        cos, sin = patch_rotary(grid, s.spatial_merge_size, self.inv_freq, patches.device)
        lengths = [h * w] * t  # each frame attends over itself
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in s.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[s.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=1)

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """[h * w, hidden] float32: the learned grid resized to h x w (bilinear, corners
        aligned, as transformers' taps and weights compute it), in merge-block-major order."""
        m, hidden = self.spec.spatial_merge_size, self.spec.hidden_size
        table = self.pos_embed.weight.float().view(self.side, self.side, hidden)
        resized = F.interpolate(
            table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=True
        )[0]
        blocks = resized.view(hidden, h // m, m, w // m, m).permute(1, 3, 2, 4, 0)
        return blocks.reshape(h * w, hidden)
