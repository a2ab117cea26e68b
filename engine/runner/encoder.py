"""The image side of a step: which rows of the flat batch are image soft tokens, their
embeddings, and the image spans the attention plan must open both ways. Images are encoded by
the model's image encoder at most once while their embeddings stay in the encoder cache, keyed
by the image's content hash and bounded in bytes (least recently used out first): a repeated
picture is not encoded again, even where its KV has left the prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from engine.core.batch import SchedulerOutput
from engine.core.images import PromptImage


@dataclass(frozen=True, slots=True)
class EncoderStats:
    hits: int  # images found in the cache
    encoded: int  # images the encoder ran on
    evicted: int
    used_bytes: int
    capacity_bytes: int
    entries: int


class EncoderCache:
    """Content hash -> soft tokens [tokens, hidden] (or [tokens, hidden * (1 + k)]: the k
    per-layer additions an encoder makes beside them, Qwen3-VL's deepstack, kept with them),
    least recently used evicted past `capacity_bytes`. An entry larger than the whole cache is
    not kept."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self.hits = self.encoded = self.evicted = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return found

    def put(self, key: bytes, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        self.encoded += 1
        if size > self.capacity_bytes or key in self.entries:
            return
        while self.used_bytes + size > self.capacity_bytes:
            _, old = self.entries.popitem(last=False)
            self.used_bytes -= old.numel() * old.element_size()
            self.evicted += 1
        self.entries[key] = value
        self.used_bytes += size

    def stats(self) -> EncoderStats:
        return EncoderStats(
            self.hits,
            self.encoded,
            self.evicted,
            self.used_bytes,
            self.capacity_bytes,
            len(self.entries),
        )


@dataclass(slots=True)
class StepImages:
    """The step's image rows (a device index into the flat batch), their soft tokens (with any
    per-layer additions along the width: the model's forward reads them), and per scheduled
    sequence the image spans its chunk computes (absolute positions)."""

    rows: torch.Tensor
    embeds: torch.Tensor
    spans: list[list[tuple[int, int]]]


class ImageEncoder:
    """The model's image encoder with its cache, on the runner's device."""

    def __init__(self, model: nn.Module, capacity_bytes: int, device: torch.device) -> None:
        self.model = model
        self.cache = EncoderCache(capacity_bytes)
        self.device = device
        self.dtype = next(model.parameters()).dtype

    def step_images(self, out: SchedulerOutput) -> StepImages | None:
        """The images the step's chunks hold, encoding those the cache lacks in one batch."""
        pieces: list[tuple[int, PromptImage, int, int]] = []  # (row, image, first, last)
        spans: list[list[tuple[int, int]]] = []
        row = 0
        for item in out.scheduled:
            r, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens - item.num_spec
            seq_spans = []
            for image in r.images:
                a, b = max(start, image.offset), min(end, image.end)
                if a < b:
                    pieces.append((row + a - start, image, a - image.offset, b - image.offset))
                    if image.two_way:  # a causal image needs no span of its own
                        seq_spans.append((image.offset, image.end))
            spans.append(seq_spans)
            row += item.num_new_tokens
        if not pieces:
            return None
        embeds = self._embeddings([image for _, image, _, _ in pieces])
        rows = [torch.arange(r0, r0 + last - first) for r0, _, first, last in pieces]
        parts = [embeds[image.content_hash][first:last] for _, image, first, last in pieces]
        return StepImages(torch.cat(rows).to(self.device), torch.cat(parts), spans)

    def _embeddings(self, images: list[PromptImage]) -> dict[bytes, torch.Tensor]:
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, PromptImage] = {}
        for image in images:
            key = image.content_hash
            if key in found or key in missing:
                continue
            cached = self.cache.get(key)
            if cached is not None:
                found[key] = cached
            else:
                missing[key] = image
        if missing:
            pixels = [image.pixels.to(self.device, self.dtype) for image in missing.values()]
            encoded = self.model.encode(pixels, [image.grid for image in missing.values()])
            for (key, image), soft in zip(missing.items(), encoded, strict=True):
                if soft.shape[0] != image.num_tokens:
                    raise ValueError(
                        f"the encoder made {soft.shape[0]} soft tokens of an image "
                        f"given {image.num_tokens} positions"
                    )
                soft = soft.clone()  # not a view of the batch: the cache keeps it alone
                self.cache.put(key, soft)
                found[key] = soft
        return found
