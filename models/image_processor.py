"""Images as a vision tower reads them, with Pillow and numpy (no torchvision): decoding untrusted
bytes within limits, then the checkpoint's own processor settings (`preprocessor_config.json`):
convert to RGB, resize, rescale, normalise, channels first, as transformers' PIL image
processors do. The content hash of an image is the hash of what the tower reads (the
preprocessed pixels), so the same picture in two requests has one identity."""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

# PIL's resampling filters by the numbers transformers' configs store (PILImageResampling)
RESAMPLE = {
    0: Image.Resampling.NEAREST,
    1: Image.Resampling.LANCZOS,
    2: Image.Resampling.BILINEAR,
    3: Image.Resampling.BICUBIC,
    4: Image.Resampling.BOX,
    5: Image.Resampling.HAMMING,
}
# transformers' IMAGENET_STANDARD_MEAN / STD: Gemma 3's processor defaults
_STANDARD = (0.5, 0.5, 0.5)
# formats Pillow may open here: raster images only (no EPS: it runs Ghostscript)
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


class ImageError(ValueError):
    """An image that cannot be read, or is outside the limits; the message says why."""


def decode_image(data: bytes, max_pixels: int, min_side: int) -> Image.Image:
    """The first frame of an image file, decoded in full, in RGB. The size is checked from the
    header before any pixel is decoded (a 40,000 x 40,000 header costs nothing); a truncated
    file, a format that is not a raster image (SVG, text), or a side below `min_side` pixels
    is an ImageError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"the image is over the limit of {max_pixels} pixels ({e})") from None
    except UnidentifiedImageError:
        why = "not a readable image (unknown format); send PNG, JPEG, GIF, WebP or BMP"
        raise ImageError(why) from None
    except OSError as e:
        raise ImageError(f"not a readable image: {e}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(
            f"{width}x{height} is {width * height} pixels, over the limit of {max_pixels}"
        )
    if min(width, height) < min_side:
        raise ImageError(f"{width}x{height} is smaller than {min_side} pixels on a side")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise ImageError(f"the {image.format} data is damaged: {e}") from None


@dataclass(frozen=True, slots=True)
class ImageProcessor:
    """A checkpoint's image processor settings: resize to (height, width), rescale, normalise."""

    height: int
    width: int
    resample: Image.Resampling = Image.Resampling.BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, float, float] = _STANDARD
    std: tuple[float, float, float] = _STANDARD

    @staticmethod
    def read(path: str, image_size: int) -> ImageProcessor:
        """`preprocessor_config.json` of an HF directory; without one, Gemma 3's defaults at the
        tower's `image_size`. Settings this processor cannot honour are refused here."""
        file = Path(path) / "preprocessor_config.json"
        cfg = json.loads(file.read_text()) if file.is_file() else {}
        if cfg.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json: pan-and-scan crops are not supported")
        if cfg.get("do_center_crop"):
            raise ValueError("preprocessor_config.json: center crop is not supported")
        size = cfg.get("size") or {}
        height = int(size.get("height", image_size))
        width = int(size.get("width", image_size))
        if (height, width) != (image_size, image_size):
            raise ValueError(
                f"preprocessor_config.json resizes to {height}x{width}; the vision tower reads "
                f"{image_size}x{image_size}"
            )
        return ImageProcessor.from_config(cfg, height, width, resample=2)

    @staticmethod
    def from_config(
        cfg: dict,
        height: int,
        width: int,
        resample: int,
        mean: tuple[float, float, float] = _STANDARD,
        std: tuple[float, float, float] = _STANDARD,
        normalize: bool = True,
    ) -> ImageProcessor:
        """The resize filter, rescale and normalisation a preprocessor_config.json `cfg` sets,
        for a resize to (height, width); `resample`, `mean`, `std` and `normalize` are the
        model's processor defaults, for what `cfg` leaves out. Raises on an unknown filter."""
        resample = cfg.get("resample", resample)
        if resample not in RESAMPLE:
            raise ValueError(f"preprocessor_config.json: unknown resample filter {resample}")
        return ImageProcessor(
            height,
            width,
            RESAMPLE[resample],
            bool(cfg.get("do_rescale", True)),
            float(cfg.get("rescale_factor", 1 / 255)),
            bool(cfg.get("do_normalize", normalize)),
            tuple(cfg.get("image_mean", mean)),
            tuple(cfg.get("image_std", std)),
        )

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[3, height, width] float32, as transformers' PIL processor computes it."""
        return resized_pixels(image, self.height, self.width, self)

    def process(self, image: Image.Image) -> tuple[np.ndarray, None]:
        """The pixels, and no patch grid (a fixed-size tower's images have none)."""
        return self(image), None


def resized_pixels(image: Image.Image, height: int, width: int, how: ImageProcessor) -> np.ndarray:
    """[3, height, width] float32: the image resized with `how`'s filter, rescaled and
    normalised as `how` says, as transformers' PIL processors compute it."""
    resized = image.convert("RGB").resize((width, height), resample=how.resample)
    pixels = np.asarray(resized).astype(np.float64)
    if how.do_rescale:
        pixels = pixels * how.rescale_factor
    pixels = pixels.astype(np.float32)
    if how.do_normalize:
        mean = np.asarray(how.mean, dtype=np.float32)
        std = np.asarray(how.std, dtype=np.float32)
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)


def content_hash(pixels: np.ndarray, grid: tuple[int, int, int] | None = None) -> bytes:
    """The identity of an image as the tower reads it: sha256 over its shape, its patch grid
    (a dynamic-resolution tower's patches of a 4x8 and an 8x4 grid have one shape) and values."""
    h = hashlib.sha256(repr(pixels.shape).encode())
    if grid is not None:
        h.update(repr(tuple(grid)).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()
