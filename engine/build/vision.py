"""The image phase of a build, for a vision-language checkpoint: its image encoder on the
serving device with the encoder cache, or the reason it cannot serve images here (refused at
startup, before traffic, rather than a wrong answer later)."""

from __future__ import annotations

import logging

import torch
from PIL import Image

from engine.config import EngineConfig, parse_bytes
from engine.core.step_budget import StepBudget
from engine.runner.encoder import ImageEncoder
from engine.spec.cost import timed_rounds
from models.loader import is_gguf
from models.spec import ModelSpec
from models.tokenizer import Tokenizer
from models.vision import AnyImageProcessor, load_image_encoder, read_image_processor

log = logging.getLogger("kvserve.engine")


def build_image_encoder(
    config: EngineConfig,
    model_path: str,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    draft_head: bool = False,
    tokenizer: Tokenizer | None = None,
) -> tuple[ImageEncoder, AnyImageProcessor] | None:
    """The encoder with its cache, and the checkpoint's image processor (an HF directory's, or
    an mmproj file's beside a GGUF: models/mmproj.py); None for a text model. `draft_head`: an
    EAGLE head drafts for the model; `tokenizer`: the one the server places images with."""
    if spec.vision is None or (is_gguf(model_path) and not config.mmproj):
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError(
            "a vision model under tensor parallelism: the other ranks' steps carry no images "
            "(serve it with tensor_parallel_size = 1)"
        )
    if draft_head and spec.mrope_section:
        raise ValueError(
            "an EAGLE draft head for a model with M-RoPE positions: the head's own rotary "
            "positions are one-axis (serve it with speculative_method = off, or n-gram drafts)"
        )
    if config.mmproj:
        from models.mmproj import load_mmproj_encoder  # imports `gguf`: GGUF serving only

        encoder, processor = load_mmproj_encoder(config.mmproj, spec, dtype, device)
        placeholder = spec.vision.image_token_id
        if tokenizer is not None and placeholder not in tokenizer.special_ids:
            tokenizer.mark_special(placeholder)  # an unused entry holds the image's positions
        log.info(
            "mmproj %s: image placeholder %s",
            config.mmproj,
            spec.vision.tower_config.get("placeholder"),
        )
    else:
        encoder = load_image_encoder(model_path, spec, dtype, device)
        processor = read_image_processor(model_path, spec.vision)
    assert encoder is not None
    capacity = parse_bytes(config.encoder_cache_bytes)
    tokens = spec.vision.tokens_per_image or "an image's own number of"
    log.info(
        "image encoder: %s, %s soft tokens an image; encoder cache %d bytes",
        spec.vision.architecture,
        tokens,
        capacity,
    )
    return ImageEncoder(encoder, capacity, device), processor


# the picture the encoder is timed on (a dynamic-resolution processor sizes it as it would a
# client's picture of this size)
PROBE_SIDE = 448


def encoder_cost(encoder: ImageEncoder, processor: AnyImageProcessor, budget: StepBudget) -> float:
    """The prefill tokens one soft token's encoding is worth in a step (the scheduler's
    `image_cost`): one image encoded, timed as the step costs are, per soft token, over a
    token's share of the step the budget holds prefills to. 0 when the steps are not timed
    (the budget counts tokens alone)."""
    if budget.costs is None:
        return 0.0
    array, grid = processor.process(Image.new("RGB", (PROBE_SIDE, PROBE_SIDE), (128, 128, 128)))
    pixels = [torch.from_numpy(array).to(encoder.device, encoder.dtype)]
    with torch.inference_mode():
        soft_tokens = encoder.model.encode(pixels, [grid])[0].shape[0]
        (times,) = timed_rounds([lambda: encoder.model.encode(pixels, [grid])], encoder.device)
    rows = budget.target_rows or budget.max_tokens
    per_token = budget.costs.cost(rows) / rows
    cost = min(times) / soft_tokens / per_token
    log.info(
        "image encoder: %.1f ms an image (%d soft tokens): %.2f prefill tokens a soft "
        "token in the step budget",
        1e3 * min(times),
        soft_tokens,
        cost,
    )
    return cost
