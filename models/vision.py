"""A vision-language checkpoint's image side, by its `VisionSpec.architecture`: the image
encoder (pixels -> soft tokens in the text model's width) and the image processor (decoded
image -> what the encoder reads). Gemma 3: models/gemma3_vision.py and image_processor.py;
Qwen2.5-VL: models/qwen_vision.py and qwen_image_processor.py; Qwen3-VL: models/qwen3_vision.py
and the same processor (transformers' `Qwen2VLImageProcessor` serves both; a Qwen3-VL
checkpoint's patch 16 and mean/std 0.5 are its `preprocessor_config.json`'s); Gemma 4:
models/gemma4_vision.py and gemma4_image_processor.py."""

from __future__ import annotations

import torch

from models.gemma3_vision import Gemma3ImageEncoder, is_image_path_tensor
from models.gemma4_image_processor import Gemma4ImageProcessor
from models.gemma4_vision import Gemma4ImageEncoder, is_gemma4_vision_tensor
from models.image_processor import ImageProcessor
from models.loader import hf_weights
from models.qwen3_vision import Qwen3VisionTower
from models.qwen_image_processor import QwenImageProcessor
from models.qwen_vision import QwenImageEncoder, QwenVisionTower, is_qwen_vision_tensor
from models.qwen_vl import QWEN_TOWERS
from models.spec import ModelSpec, VisionSpec

AnyImageProcessor = ImageProcessor | QwenImageProcessor | Gemma4ImageProcessor
ImageEncoderModel = Gemma3ImageEncoder | QwenImageEncoder | Gemma4ImageEncoder


def load_image_encoder(
    path: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str
) -> ImageEncoderModel | None:
    """The checkpoint's image encoder in `dtype` on `device`; None for a text model."""
    if spec.vision is None:
        return None
    encoder: ImageEncoderModel
    if spec.vision.architecture in QWEN_TOWERS:
        tower = Qwen3VisionTower if spec.vision.architecture == "qwen3_vl" else QwenVisionTower
        encoder = QwenImageEncoder(spec.vision, spec.hidden_size, tower)
        encoder.load_weights(hf_weights(path, dtype, keep=is_qwen_vision_tensor))
    elif spec.vision.architecture == "gemma4":
        encoder = Gemma4ImageEncoder(spec.vision, spec.hidden_size)
        encoder.load_weights(hf_weights(path, dtype, keep=is_gemma4_vision_tensor))
    else:
        encoder = Gemma3ImageEncoder(spec.vision, spec.hidden_size)
        encoder.load_weights(hf_weights(path, dtype, keep=is_image_path_tensor))
    return encoder.to(device=device, dtype=dtype).eval()


def read_image_processor(path: str, vision: VisionSpec) -> AnyImageProcessor:
    """The checkpoint's processor settings (`preprocessor_config.json`), checked against its
    tower."""
    if vision.architecture in QWEN_TOWERS:
        return QwenImageProcessor.read(path, vision.tower_config)
    if vision.architecture == "gemma4":
        return Gemma4ImageProcessor.read(path, vision.tower_config)
    return ImageProcessor.read(path, int(vision.tower_config["image_size"]))
