"""Gemma 4's image processor (transformers' `Gemma4ImageProcessorPil`), with Pillow and numpy:
an image is resized, its aspect kept, to the largest sides that are multiples of patch x
pooling kernel within `max_soft_tokens` x kernel^2 patches, rescaled to [0, 1] (the tower maps
it to [-1, 1] itself; no normalisation), and cut into patches: rows of patch x patch x 3
values, row-major over the patch grid (1, h, w). Each kernel x kernel block of patches becomes
one soft token. Transformers pads every image to the budget's patch count; the padding is
masked out of the tower and stripped from its output, so it is not made here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from models.image_processor import ImageError, ImageProcessor, resized_pixels

# the soft-token budgets transformers' processor accepts
_SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


def aspect_preserving_size(
    height: int, width: int, patch: int, max_patches: int, kernel: int
) -> tuple[int, int]:
    """transformers' `get_aspect_ratio_preserving_size`: the largest sides, multiples of
    patch x kernel, whose patches fit `max_patches` at the image's aspect."""
    target_px = max_patches * patch**2
    factor = math.sqrt(target_px / (height * width))
    side = kernel * patch
    h, w = math.floor(factor * height / side) * side, math.floor(factor * width / side) * side
    if h == 0 and w == 0:
        raise ImageError(f"{width}x{height} resizes to nothing")
    longest = (max_patches // kernel**2) * side
    if h == 0:
        h, w = side, min(math.floor(width / height) * side, longest)
    elif w == 0:
        w, h = side, min(math.floor(height / width) * side, longest)
    if h * w > target_px:
        raise ImageError(f"{width}x{height} resizes past {max_patches} patches")
    return h, w


@dataclass(frozen=True, slots=True)
class Gemma4ImageProcessor:
    """A checkpoint's settings; `rescale` holds the resize filter and the rescale factor."""

    rescale: ImageProcessor
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3

    @staticmethod
    def read(path: str, tower: dict) -> Gemma4ImageProcessor:
        """`preprocessor_config.json` of an HF directory (transformers' defaults where it has
        none); its patch and kernel must be the tower's."""
        file = Path(path) / "preprocessor_config.json"
        cfg = json.loads(file.read_text()) if file.is_file() else {}
        cfg = cfg.get("image_processor", cfg)  # a processor_config.json's nesting
        rescale = ImageProcessor.from_config(cfg, 0, 0, 3, normalize=False)
        if rescale.do_normalize:
            raise ValueError("preprocessor_config.json: Gemma 4 with do_normalize is not supported")
        if cfg.get("do_resize") is False:
            raise ValueError("preprocessor_config.json: do_resize false is not supported")
        out = Gemma4ImageProcessor(
            rescale,
            int(cfg.get("patch_size", 16)),
            int(cfg.get("max_soft_tokens", 280)),
            int(cfg.get("pooling_kernel_size", 3)),
        )
        if out.max_soft_tokens not in _SOFT_TOKEN_BUDGETS:
            raise ValueError(
                f"preprocessor_config.json: max_soft_tokens {out.max_soft_tokens} is not one of "
                f"{_SOFT_TOKEN_BUDGETS}"
            )
        ours = (out.patch_size, out.pooling_kernel_size)
        theirs = (tower.get("patch_size", 16), tower.get("pooling_kernel_size", 3))
        if ours != theirs:
            raise ValueError(
                f"preprocessor_config.json cuts (patch, kernel) {ours}; the vision tower "
                f"reads {theirs}"
            )
        return out

    def process(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Patches [h * w, patch^2 * 3] float32 and the grid (1, h, w)."""
        p, k = self.patch_size, self.pooling_kernel_size
        height, width = aspect_preserving_size(
            image.height, image.width, p, self.max_soft_tokens * k * k, k
        )
        pixels = resized_pixels(image, height, width, self.rescale)
        c, gh, gw = pixels.shape[0], height // p, width // p
        patches = pixels.reshape(c, gh, p, gw, p).transpose(1, 3, 2, 4, 0)
        return np.ascontiguousarray(patches.reshape(gh * gw, p * p * c), np.float32), (1, gh, gw)
