"""The image phase of a build, for a vision-language checkpoint: its image encoder on the
serving device with the encoder cache, or the reason it cannot serve images here (refused at
startup, before traffic, rather than a wrong answer later)."""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, parse_bytes
from engine.core.step_budget import StepBudget
from engine.runner.encoder import ImageEncoder
from engine.spec.cost import timed_rounds
from models.image_processor import ImageProcessor
from models.loader import is_gguf, load_image_encoder
from models.spec import ModelSpec

log = logging.getLogger("kvserve.engine")


def build_image_encoder(
    config: EngineConfig, model_path: str, spec: ModelSpec, dtype: torch.dtype,
    device: torch.device,
) -> tuple[ImageEncoder, ImageProcessor] | None:  # fmt: skip
    """The encoder with its cache, and the checkpoint's image processor; None for a text
    model."""
    if spec.vision is None or is_gguf(model_path):
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError(
            "a vision model under tensor parallelism: the other ranks' steps carry no images "
            "(serve it with tensor_parallel_size = 1)"
        )
    encoder = load_image_encoder(model_path, spec, dtype, device)
    assert encoder is not None
    processor = ImageProcessor.read(model_path, int(spec.vision.tower_config["image_size"]))
    capacity = parse_bytes(config.encoder_cache_bytes)
    log.info("image encoder: %s, %d soft tokens an image; encoder cache %d bytes",
             spec.vision.architecture, spec.vision.tokens_per_image, capacity)  # fmt: skip
    return ImageEncoder(encoder, capacity, device), processor


def encoder_cost(encoder: ImageEncoder, processor: ImageProcessor, budget: StepBudget) -> float:
    """The prefill tokens one soft token's encoding is worth in a step (the scheduler's
    `image_cost`): one image of the processor's size encoded, timed as the step costs are,
    per soft token, over a token's share of the step the budget holds prefills to. 0 when the
    steps are not timed (the budget counts tokens alone)."""
    if budget.costs is None:
        return 0.0
    pixels = torch.zeros(1, 3, processor.height, processor.width, device=encoder.device,
                         dtype=encoder.dtype)  # fmt: skip
    with torch.inference_mode():
        soft_tokens = encoder.model(pixels).shape[1]
        (times,) = timed_rounds([lambda: encoder.model(pixels)], encoder.device)
    rows = budget.target_rows or budget.max_tokens
    per_token = budget.costs.cost(rows) / rows
    cost = min(times) / soft_tokens / per_token
    log.info("image encoder: %.1f ms an image (%d soft tokens): %.2f prefill tokens a soft "
             "token in the step budget", 1e3 * min(times), soft_tokens, cost)  # fmt: skip
    return cost
