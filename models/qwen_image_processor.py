"""Qwen2-VL / Qwen2.5-VL's image processor (transformers' `Qwen2VLImageProcessorPil`), with
Pillow and numpy: dynamic resolution. An image is resized to sides that are multiples of
patch x merge within [min_pixels, max_pixels] keeping its aspect (`smart_resize`), rescaled and
normalised, then cut into patches: rows of temporal x patch x patch x 3 values (a still image
repeated over the temporal patch), ordered merge-block-major, and the patch grid (1, h, w)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from models.image_processor import ImageError, ImageProcessor, resized_pixels

# transformers' OPENAI_CLIP_MEAN / STD: Qwen2-VL's processor defaults
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Sides divisible by `factor`, their product within [min_pixels, max_pixels], the aspect
    kept as nearly as may be (transformers' `smart_resize`)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"{width}x{height}: the aspect ratio is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class QwenImageProcessor:
    """A checkpoint's dynamic-resolution settings; `normalise` holds the resize filter,
    rescale and normalisation (its fixed size unused)."""

    normalise: ImageProcessor
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    @staticmethod
    def read(path: str, tower: dict) -> QwenImageProcessor:
        """`preprocessor_config.json` of an HF directory (its `size` or the older `min_pixels`
        / `max_pixels`); its patch geometry must be the tower's."""
        file = Path(path) / "preprocessor_config.json"
        cfg = json.loads(file.read_text()) if file.is_file() else {}
        size = cfg.get("size") or {}
        normalise = ImageProcessor.from_config(cfg, 0, 0, 3, _CLIP_MEAN, _CLIP_STD)
        out = QwenImageProcessor(
            normalise,
            int(size.get("shortest_edge", cfg.get("min_pixels", 56 * 56))),
            int(size.get("longest_edge", cfg.get("max_pixels", 28 * 28 * 1280))),
            int(cfg.get("patch_size", tower.get("patch_size", 14))),
            int(cfg.get("temporal_patch_size", tower.get("temporal_patch_size", 2))),
            int(cfg.get("merge_size", tower.get("spatial_merge_size", 2))),
        )
        ours = (out.patch_size, out.temporal_patch_size, out.merge_size)
        theirs = (
            tower.get("patch_size"),
            tower.get("temporal_patch_size", 2),
            tower.get("spatial_merge_size", 2),
        )
        if ours != theirs:
            raise ValueError(
                f"preprocessor_config.json cuts (patch, temporal, merge) {ours}; "
                f"the vision tower reads {theirs}"
            )
        if cfg.get("do_resize") is False:
            raise ValueError("preprocessor_config.json: do_resize false is not supported")
        return out

    def process(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Patches [h * w, 3 * temporal * patch^2] float32 and the grid (1, h, w)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        height, width = smart_resize(
            image.height, image.width, p * m, self.min_pixels, self.max_pixels
        )
        pixels = resized_pixels(image, height, width, self.normalise)
        c, gh, gw = pixels.shape[0], height // p, width // p
        blocks = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        patches = np.ascontiguousarray(repeated.reshape(gh * gw, c * t * p * p), np.float32)
        return patches, (1, gh, gw)
