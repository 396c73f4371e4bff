"""Encoded images to RGB uint8 pixels: whole (PIL or simplejpeg), or only the region a crop needs
(libjpeg-turbo's region decoding, `loadopt._jpeg`), optionally at a reduced DCT scale.

Whatever the file's name says, the bytes decide: a JPEG goes to simplejpeg when asked for, anything
else (a PNG named .JPEG, a GIF, a TIFF) to PIL; grayscale, CMYK and palette images come out RGB. A JPEG XL
image made from pixels goes to libjxl (a recompressed JPEG never gets here: the sources' `read` gives back its
JPEG).
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
from PIL import Image

from loadopt.imaging import jxl
from loadopt.imaging.geometry import Box, whole_pixels

try:  # the faster libjpeg-turbo binding, GIL released while decoding
    import simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is a dependency, but stay usable without it
    simplejpeg = None

try:  # libjpeg-turbo's region decoding, built at install where libjpeg-turbo's headers are
    from loadopt import _jpeg as jpeg_region
except ImportError:  # pragma: no cover - optional; JPEGs are then decoded whole
    jpeg_region = None  # type: ignore[assignment]  # None where the optional module is absent

Encoded = bytes | bytearray | memoryview  # one sample's stored bytes (a view of a mapped file is fine)
CropPlan = Callable[[int, int], tuple[Box, bool]]  # (source width, height) -> (crop box, flip)
JPEG_MAGIC = b"\xff\xd8"


def is_jpeg(data: Encoded) -> bool:
    return bytes(data[:2]) == JPEG_MAGIC


def decode_pil(data: Encoded) -> Image.Image:
    """Any image PIL reads (or libjxl), as an RGB PIL image."""
    if jxl.is_jxl(data):
        return Image.fromarray(jxl.decode_pixels(data))
    image = Image.open(io.BytesIO(data))
    image.load()  # decode errors surface here, not later
    return image.convert("RGB") if image.mode != "RGB" else image


def decode_array(data: Encoded, decoder: str) -> np.ndarray:
    """Decode to a writable HWC uint8 RGB array: simplejpeg for JPEGs when `decoder` is "simplejpeg"
    (and it is installed), PIL otherwise."""
    if decoder == "simplejpeg" and simplejpeg is not None and is_jpeg(data):
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    return np.array(decode_pil(data))


def decode_fast(data: Encoded) -> Image.Image:
    """simplejpeg for JPEGs when installed, PIL for anything else; as a PIL image."""
    return Image.fromarray(decode_array(data, "simplejpeg"))


def dct_denominator(box: tuple[int, int, int, int], size: int) -> int:
    """The largest JPEG DCT scale 1/d (d in 1, 2, 4, 8) at which the crop `box` still has at least
    `size` pixels each way: a crop at least twice the output is decoded at half scale or smaller."""
    width, height = box[2] - box[0], box[3] - box[1]
    return next(d for d in (8, 4, 2, 1) if d == 1 or (width >= d * size and height >= d * size))


def decode_for_crop(data: Encoded, decoder: str, plan: CropPlan, region: bool = True,
                    reduced_for: int | None = None) -> tuple[np.ndarray, Box, bool]:
    """Decode what one crop needs: (HWC uint8 pixels, the crop box in their coordinates, flip), the box and
    flip from `plan(source width, source height)`.

    With `region` (the default) and libjpeg-turbo's region decoding built (`loadopt._jpeg`), a JPEG
    for simplejpeg is decoded only over the crop's whole-pixel box: rows above it skipped, columns
    outside it never inverse-transformed, nothing below it read; the pixels equal the full decode's
    crop (tests/test_transforms.py), in less time. Otherwise the whole image is decoded.
    A JPEG the region decoder refuses (CMYK, corrupt) goes to the whole-image decoder, which reports it;
    damage below the crop goes unnoticed by the region decoder (it never reads there).

    `reduced_for` = the output size: a crop at least twice that is decoded at a reduced DCT scale
    (`dct_denominator`), the box in the scaled image's whole pixels. Other pixels than the full
    decode's (the DCT's downscale, then the resize), far less work on large photos; off by default."""
    if region and decoder == "simplejpeg" and jpeg_region is not None and is_jpeg(data):
        try:
            width, height = jpeg_region.header(data)
            box, flip = plan(width, height)
            left, top, right, bottom = whole_pixels(box)
            denom = dct_denominator((left, top, right, bottom), reduced_for) if reduced_for else 1
            if denom > 1:  # the scaled image is ceil(width / denom) wide; the box in its whole pixels
                scaled_width, scaled_height = -(-width // denom), -(-height // denom)
                left, top = min(round(left / denom), scaled_width - 1), min(round(top / denom), scaled_height - 1)
                right = max(min(round(right / denom), scaled_width), left + 1)
                bottom = max(min(round(bottom / denom), scaled_height), top + 1)
            region_pixels = jpeg_region.decode_region(data, denom, left, top, right, bottom)
        except ValueError:
            pass
        else:
            return (np.frombuffer(region_pixels, np.uint8).reshape(bottom - top, right - left, 3),
                    (0, 0, right - left, bottom - top), flip)
    pixels = decode_array(data, decoder)
    box, flip = plan(pixels.shape[1], pixels.shape[0])
    return pixels, box, flip
