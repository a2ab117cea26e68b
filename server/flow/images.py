"""A conversation's images, from what the client sent to what the engine takes: the bytes (a
data: URL; a remote URL only from a host in `allowed_media_domains`), decoded within the limits
on count, bytes and pixels, made pixels by the model's own processor and hashed; then placed in
the rendered prompt where the chat template put each image's marker, widened into the soft
tokens the model's processor writes (Gemma 3: "\\n\\n<start_of_image>" + N x
"<image_soft_token>" + "<end_of_image>\\n\\n"). Every refusal is a 400 naming the part."""

from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np
import torch

from engine.async_engine import AsyncEngine
from engine.core.images import PromptImage
from models.image_processor import ImageError, content_hash, decode_image
from models.spec import VisionSpec
from models.tokenizer import Tokenizer
from models.vision import AnyImageProcessor
from server.config import ServerConfig
from server.errors import APIError
from server.flow.conversation import Conversation, ImageRef

FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class LoadedImage:
    pixels: np.ndarray  # float32, the model's processor's (models/vision.py)
    content_hash: bytes
    grid: tuple[int, int, int] | None = None  # a dynamic-resolution tower's patch grid


ImageSet = dict[ImageRef, LoadedImage]


def _refuse(ref: ImageRef, why: str, code: str = "invalid_image") -> APIError:
    return APIError(400, f"{ref.param}: {why}", param=ref.param, code=code)


def images_of(conversation: Conversation) -> list[ImageRef]:
    """Every image of the conversation, in order."""
    return [p for turn in conversation.turns for p in turn.parts if isinstance(p, ImageRef)]


async def load_images(
    cfg: ServerConfig, engine: AsyncEngine, conversation: Conversation
) -> ImageSet:
    """Every image of the conversation, read and preprocessed (none: {})."""
    refs = images_of(conversation)
    if not refs:
        return {}
    processor = engine.image_processor
    if processor is None or engine.vision is None:
        raise _refuse(
            refs[0], "this model takes text only; an image cannot be read", "unsupported_content"
        )
    if len(refs) > cfg.max_images_per_request:
        raise _refuse(
            refs[cfg.max_images_per_request],
            f"at most {cfg.max_images_per_request} images a request",
        )
    loaded: ImageSet = {}
    for ref in refs:
        if ref not in loaded:
            data = await image_bytes(ref, cfg)
            loaded[ref] = await asyncio.to_thread(_preprocess, ref, data, processor, cfg)
    return loaded


def _preprocess(
    ref: ImageRef, data: bytes, processor: AnyImageProcessor, cfg: ServerConfig
) -> LoadedImage:
    try:
        image = decode_image(data, cfg.max_image_pixels, cfg.min_image_side)
        pixels, grid = processor.process(image)
    except ImageError as e:
        raise _refuse(ref, str(e)) from None
    return LoadedImage(pixels, content_hash(pixels, grid), grid)


async def image_bytes(ref: ImageRef, cfg: ServerConfig) -> bytes:
    """The image file a reference names: a base64 data: URL decoded, or a remote file fetched
    from an allowed host; at most `max_image_bytes`."""
    url, limit = ref.url.strip(), cfg.max_image_bytes
    if url.startswith("data:"):
        head, comma, payload = url[5:].partition(",")
        media, *flags = head.split(";")
        if not comma or "base64" not in flags:
            raise _refuse(ref, "a data: URL image must be base64 (data:image/png;base64,...)")
        if not media.lower().startswith("image/"):
            raise _refuse(ref, f"a data: URL of type {media or 'text/plain'!r} is not an image")
        if len(payload) * 3 // 4 > limit + 2:
            raise _refuse(ref, f"the image is larger than {limit} bytes")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _refuse(ref, "the data: URL is not valid base64") from None
        if len(data) > limit:
            raise _refuse(ref, f"the image is {len(data)} bytes, over the limit of {limit}")
        return data
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise _refuse(ref, "an image URL is a data: URL or an http(s) URL")
    allowed = [d.lower() for d in cfg.allowed_media_domains]
    if parsed.hostname.lower() not in allowed:
        hosts = ", ".join(allowed) if allowed else "none are set"
        raise _refuse(
            ref,
            f"images are not fetched from {parsed.hostname} (send a data: URL; "
            f"the server fetches only from allowed_media_domains: {hosts})",
            "media_domain_not_allowed",
        )
    return await asyncio.to_thread(_fetch, ref, url, limit)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a redirect could lead off the allowed hosts: it is an error instead


def _fetch(ref: ImageRef, url: str, limit: int) -> bytes:
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(limit + 1)
    except urllib.error.HTTPError as e:
        raise _refuse(ref, f"fetching the image: HTTP {e.code} from {url}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise _refuse(ref, f"fetching the image from {url} failed: {reason}") from None
    if len(data) > limit:
        raise _refuse(ref, f"the image at {url} is larger than {limit} bytes")
    return data


@dataclass(frozen=True, slots=True)
class ImageMarkup:
    """How a model's prompt holds an image: the chat template writes `marker` where the image
    goes, and the processor widens it into `expansion(n)` for an image of n soft tokens (whose
    placeholder tokens the soft tokens replace)."""

    marker: str
    begin: str
    end: str
    image: str
    image_token_id: int
    kind: str  # VisionSpec.marker: "begin", "image" or "wrapped"

    @staticmethod
    def of(tokenizer: Tokenizer, vision: VisionSpec) -> ImageMarkup:
        def text(token_id: int | None) -> str:
            found = tokenizer.id_to_token(token_id) if token_id is not None else None
            return found or ""

        begin, end = text(vision.begin_token_id), text(vision.end_token_id)
        image = text(vision.image_token_id)
        if not begin or not image:
            raise ValueError("the tokenizer lacks the model's image tokens")
        marker = begin if vision.marker == "begin" else image
        return ImageMarkup(marker, begin, end, image, vision.image_token_id, vision.marker)

    def expansion(self, n: int) -> str:
        if self.kind == "begin":  # Gemma 3's processor: its `full_image_sequence`
            return f"\n\n{self.begin}{self.image * n}{self.end}\n\n"
        if self.kind == "wrapped":  # Gemma 4's: the placeholder between begin and end
            return f"{self.begin}{self.image * n}{self.end}"
        return self.image * n  # Qwen's: the template wrote the begin and end tokens around it


def place_images(
    tokenizer: Tokenizer, vision: VisionSpec, text: str, images: list[LoadedImage], param: str
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The rendered prompt's token ids with each image's marker widened, and the images at their
    soft tokens. The template must have written one marker per image, and the text no stray
    placeholder (a 400 naming the field that holds the turns)."""
    markup = ImageMarkup.of(tokenizer, vision)
    pieces = text.split(markup.marker)
    if len(pieces) - 1 != len(images):
        raise APIError(
            400,
            f"{param}: the chat template placed {len(pieces) - 1} "
            f"image markers for {len(images)} images",
            param=param,
        )
    counts = [vision.image_tokens(image.grid) for image in images]
    widened = pieces[0] + "".join(markup.expansion(n) + rest for n, rest in zip(counts, pieces[1:]))
    ids = tokenizer.encode(widened, add_special_tokens=False)
    image_id = markup.image_token_id
    starts = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != t)]
    runs_ok = len(starts) == len(images) and all(
        ids[s : s + n] == [image_id] * n for s, n in zip(starts, counts)
    )
    if not runs_ok or ids.count(image_id) != sum(counts):
        raise APIError(
            400,
            f"{param}: the text holds the model's image placeholder token; "
            "send images as image parts",
            param=param,
        )
    placed = tuple(
        PromptImage(
            s, n, image.content_hash, torch.from_numpy(image.pixels), image.grid, vision.two_way
        )
        for s, n, image in zip(starts, counts, images, strict=True)
    )
    return ids, placed
