"""The decoded forms' pixels of one encoded sample: its whole frame (longer side bounded, as FFCV's
`max_resolution`) with the dims that place a crop in it, or its centre square."""

from __future__ import annotations

import numpy as np
from PIL import Image

from loadopt.imaging.decode import Encoded, decode_array
from loadopt.imaging.geometry import center_crop_box

FRAME_FIELDS = ("height", "width", "source_height", "source_width")  # per-sample int32 dims of a whole frame
FrameDims = tuple[int, int, int, int]  # FRAME_FIELDS' values


def scaled_frame(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(width, height) of a frame stored with its longer side at most `max_side` (never enlarged)."""
    longer = max(width, height)
    if longer <= max_side:
        return width, height
    return max(1, round(width * max_side / longer)), max(1, round(height * max_side / longer))


def stored_frame(data: Encoded, max_side: int) -> tuple[bytes, FrameDims]:
    """The whole-frame form of one encoded sample: its HWC uint8 pixels, longer side at most `max_side`
    (PIL's antialiased bilinear where it shrinks; as decoded otherwise), and its `FRAME_FIELDS`
    (height, width, source height, source width)."""
    pixels = decode_array(data, "simplejpeg")
    source_height, source_width = pixels.shape[:2]
    width, height = scaled_frame(source_width, source_height, max_side)
    if (width, height) != (source_width, source_height):
        pixels = np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR))
    return np.ascontiguousarray(pixels).tobytes(), (height, width, source_height, source_width)


def centre_square(data: Encoded, size: int) -> bytes:
    """The centre-square form of one encoded sample: the shorter side resized to `size` (PIL's bilinear,
    antialiased), centre-cropped; HWC uint8 bytes."""
    pixels = decode_array(data, "simplejpeg")
    height, width = pixels.shape[:2]
    box = center_crop_box(width, height, fraction=1.0)
    return Image.fromarray(pixels).resize((size, size), Image.Resampling.BILINEAR, box=box).tobytes()
