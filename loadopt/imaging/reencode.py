"""The encoded forms' JPEGs bounded by `pipeline.max_side`: a source whose longer side is larger is stored
re-encoded at <= max_side (as FFCV's .beton `jpg` mode stores it: `max_resolution`, quality 90); one
within it keeps its own bytes (no recompression).

Both encoded forms store each JPEG with restart markers (`with_restarts`): the same coefficients, so
the same pixels bit for bit, re-entropy-coded (optimised Huffman tables, a little smaller) with a marker
every ~64 pixels of each MCU row, so that the region decoder reads only the intervals around a crop
(`loadopt._jpeg`), which skips the entropy decoding of the rows above a crop that a marker per row or
none still pays. Without the native module the bytes are stored as they are.

The shrink decodes at the smallest DCT scale that still gives the bounded frame's pixels each way
(libjpeg-turbo's scaled IDCT through simplejpeg: a 3000 x 2000 photo bound to 512 x 341 is decoded at
1/4 each way, 750 x 500, a sixteenth of its pixels), then resizes with PIL's antialiased bilinear (the
`frames` form's kernel) and encodes with libjpeg-turbo at `quality`, 4:2:0 chroma (the sources' and
OpenCV's default, as FFCV writes).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from loadopt.imaging.decode import Encoded, decode_array, is_jpeg, jpeg_region
from loadopt.imaging.frames import scaled_frame

try:
    import simplejpeg
except ImportError:  # pragma: no cover - a dependency; PIL decodes and encodes without it
    simplejpeg = None

REENCODE_QUALITY = 90  # FFCV's default jpeg_quality; in the conversion's cache key and the recipe's label
# Pixels between restart markers: the coarsest interval that decoded regions as fast as finer ones did
# (coarser reads more around each crop; finer adds a marker's bytes per interval).
RESTART_INTERVAL_PX = 64


def restarts_key() -> int | None:
    """What the encoded forms' cache keys hold of `with_restarts` (None: the native module is absent)."""
    return RESTART_INTERVAL_PX if jpeg_region is not None else None


def with_restarts(data: Encoded) -> bytes:
    """A JPEG's coefficients re-entropy-coded with restart markers that tile its MCU rows (`_jpeg`'s
    `with_restarts`): lossless. Anything it does not transcode (not a JPEG, CMYK, damaged) as it is,
    to be decoded, or reported, as the source would be."""
    if jpeg_region is None or not is_jpeg(data):
        return bytes(data)
    transcoded = jpeg_region.with_restarts(data, RESTART_INTERVAL_PX)
    return bytes(data) if transcoded is None else transcoded


def source_size(data: Encoded) -> tuple[int, int]:
    """(width, height) from the header alone (a JPEG's, else whatever PIL reads); raises on a bad header."""
    if simplejpeg is not None and is_jpeg(data):
        height, width, _, _ = simplejpeg.decode_jpeg_header(bytes(data))
        return int(width), int(height)
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def shrunk_pixels(data: Encoded, width: int, height: int) -> np.ndarray:
    """The image's HWC uint8 RGB pixels resized to `width` x `height` (a shrink): a JPEG decoded at the
    smallest DCT scale with at least those pixels each way, then PIL's antialiased bilinear."""
    if simplejpeg is not None and is_jpeg(data):
        pixels = simplejpeg.decode_jpeg(bytes(data), colorspace="RGB", min_width=width, min_height=height)
    else:
        pixels = decode_array(data, "pil")
    if pixels.shape[1] == width and pixels.shape[0] == height:
        return pixels
    return np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR))


def bounded_jpeg(data: Encoded, max_side: int, quality: int = REENCODE_QUALITY) -> bytes:
    """One sample's bytes in the bounded encoded form: the source's own bytes when its longer side is at
    most `max_side`, else its frame scaled to a longer side of `max_side` (`frames.scaled_frame`) as a
    JPEG of `quality`, 4:2:0; either with restart markers (`with_restarts`). Raises (ValueError, OSError)
    on a source that cannot be decoded."""
    source_width, source_height = source_size(data)
    width, height = scaled_frame(source_width, source_height, max_side)
    if (width, height) == (source_width, source_height):
        return with_restarts(data)
    pixels = np.ascontiguousarray(shrunk_pixels(data, width, height))
    if simplejpeg is not None:
        return with_restarts(simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling="420"))
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality, subsampling=2)
    return with_restarts(out.getvalue())
