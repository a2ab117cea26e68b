"""A prompt's images, as leaf values every room may read: where each image's placeholder tokens
sit in the prompt, its content hash (what the prefix cache and the encoder cache key it by),
and the pixels its model's processor made of it. The server builds them (decoding, limits,
the chat template's placeholders); the engine checks them against the prompt, hashes them
into the blocks they cover, encodes them and places their soft tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, eq=False)
class PromptImage:
    """One image of a prompt: its soft tokens take positions [offset, offset + num_tokens),
    which attend to each other in both directions where `two_way` (Gemma 3; Qwen's are causal
    like text). `grid`: a dynamic-resolution tower's patch grid (t, h, w), which its pixels
    are patches of (Qwen2.5-VL: [t * h * w, patch values]); None for a fixed-size tower."""

    offset: int
    num_tokens: int
    content_hash: bytes  # sha256 of the preprocessed pixels (models/image_processor.py)
    pixels: torch.Tensor  # [channels, height, width] float32, as the model's processor made it
    grid: tuple[int, int, int] | None = None
    two_way: bool = True

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def identity(self) -> PromptImage:
        """The image as the block hashes know it, without its pixels (what is kept beyond the
        request: an idle session's offload rebuilds its hashes from it)."""
        return PromptImage(
            self.offset, self.num_tokens, self.content_hash, torch.empty(0), self.grid, self.two_way
        )


def image_keys(images: Sequence[PromptImage], start: int, end: int) -> bytes:
    """What the images overlapping token positions [start, end) add to that block's hash: each
    one's content hash and where it begins relative to the block, so the same placeholder
    tokens hold another picture's KV under another hash."""
    keys = b""
    for image in images:
        if image.offset < end and image.end > start:
            keys += (
                b"img:"
                + image.content_hash
                + (image.offset - start).to_bytes(8, "little", signed=True)
            )
    return keys


def cut_at_image(images: Sequence[PromptImage], start: int, n: int) -> int:
    """The chunk size to grant instead of `n` tokens from `start`, so that no chunk ends inside
    an image: an image's soft tokens attend to each other in both directions, so the ones of
    this chunk cannot be computed before the rest of their image is in the same step. The
    chunk stops before the image, or, when it begins at or inside one, takes the image's
    remainder whole (it may then exceed `n`). A causal image (not `two_way`) may be split."""
    end = start + n
    for image in images:
        if image.two_way and image.offset < end < image.end:
            return image.offset - start if image.offset > start else image.end - start
    return n


def encoder_charge(
    images: Sequence[PromptImage], start: int, n: int, cost: float, admitted: bool = False
) -> int:
    """Step-budget tokens the image encoder's work in a chunk of `n` tokens from `start` is
    worth, at `cost` prefill tokens per soft token (measured at startup,
    engine/build/vision.py): an image is encoded whole in the step whose chunk first reaches
    it, the one it begins in, or the first chunk of an admission that begins inside it (a
    prefix hit that ends there); a later chunk of an image split across steps finds it in
    the encoder cache. An image the encoder cache holds is charged alike: the scheduler does
    not see the cache, and a charge too high only shortens one step."""
    if cost <= 0:
        return 0
    end = start + n
    soft = 0
    for image in images:
        if start <= image.offset < end or (admitted and image.offset < start < image.end):
            soft += image.num_tokens
    return int(soft * cost + 0.5)
