"""Gemma 3's image path (`Gemma3ForConditionalGeneration`): the SigLIP tower (models/siglip.py),
then the multimodal projector: the patch grid average-pooled to `mm_tokens_per_image` soft
tokens, Gemma's RMSNorm (`1 + w`), and a matrix into the text model's width. The text model is
Gemma 3's (models/gemma3.py); the soft tokens replace the embeddings of the image placeholder
positions, unscaled (Gemma scales only the token embeddings by sqrt(hidden)), as transformers'
`Gemma3Model.forward` scatters them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models.siglip import SiglipSpec, SiglipVisionTower
from models.spec import VisionSpec

# where a checkpoint keeps the image path's tensors (transformers 5 saves the first spelling,
# older and newer conversions the second)
_PREFIXES = ("vision_tower.", "multi_modal_projector.")
_NESTED = "model."


def gemma3_vision_spec(cfg: dict) -> VisionSpec | None:
    """The image side of a Gemma 3 ConditionalGeneration config (None: it has no tower)."""
    tower = cfg.get("vision_config")
    if not tower:
        return None
    if tower.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"Gemma 3 vision tower {tower.get('model_type')!r} is not supported")
    return VisionSpec(
        architecture="gemma3",
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262_144))),
        tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
        begin_token_id=cfg.get("boi_token_index", cfg.get("boi_token_id")),
        end_token_id=cfg.get("eoi_token_index", cfg.get("eoi_token_id")),
        tower_config=dict(tower),
    )


def is_image_path_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the image path, not the text model."""
    name = name[len(_NESTED) :] if name.startswith(_NESTED) else name
    return name.startswith(_PREFIXES)


class _Projector(nn.Module):
    def __init__(self, tower: SiglipSpec, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(tower.hidden_size, text_hidden), requires_grad=False
        )
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(
            torch.empty(tower.hidden_size), requires_grad=False
        )
        self.eps = tower.layer_norm_eps
        self.side = tower.patches_per_side
        per_side = int(tokens_per_image**0.5)
        if per_side * per_side != tokens_per_image or self.side % per_side:
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} does not pool a {self.side}x{self.side} "
                "patch grid into a square"
            )
        self.kernel = self.side // per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).to(patches.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight)


class Gemma3ImageEncoder(nn.Module):
    """Pixels [images, 3, size, size] -> soft tokens [images, tokens_per_image, text hidden]."""

    def __init__(self, vision: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        tower = SiglipSpec.of(vision.tower_config)
        self.image_size = tower.image_size
        self.vision_tower = SiglipVisionTower(tower)
        self.multi_modal_projector = _Projector(tower, text_hidden, vision.tokens_per_image)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))

    def encode(
        self, pixels: list[torch.Tensor], grids: list[tuple[int, int, int] | None]
    ) -> list[torch.Tensor]:
        """Images of one size, in one batch; a fixed-size tower's have no grid."""
        return list(self(torch.stack(pixels)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The image path's tensors of a checkpoint (others are skipped); raises on a missing
        one. A SigLIP pooling head, which Gemma 3 never reads, is skipped too."""
        state = {}
        for name, tensor in weights:
            name = name[len(_NESTED) :] if name.startswith(_NESTED) else name
            if name.startswith(_PREFIXES) and not name.startswith("vision_tower.head."):
                state[name] = tensor
        self.load_state_dict(state, strict=True)
