"""JPEG XL recompressed JPEGs: a JPEG stored about a fifth smaller, its exact bytes given back on read.

JPEG XL keeps a JPEG's DCT coefficients and the data to rebuild its file (libjxl's JPEG reconstruction,
through `imagecodecs`: the `jxl` extra), so `recompress_jpeg` stores the same image in fewer bytes and
`decodable` gives back the very JPEG, byte for byte, before any decoder sees it: every pixel, crop and
restart marker downstream is the JPEG's. A JPEG whose reconstruction would differ (a rare marker libjxl
does not keep) is left a JPEG. A JPEG XL image made from pixels, not from a JPEG, has no JPEG inside:
`decodable` leaves it, and `decode_pixels` decodes it.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from loadopt.errors import ConfigError

# A bare codestream, or the ISO BMFF container (which reconstructible files use: the `jbrd` box)
JXL_CODESTREAM = b"\xff\x0a"
JXL_CONTAINER = b"\x00\x00\x00\x0cJXL \x0d\x0a\x87\x0a"


def codec() -> ModuleType:
    """imagecodecs, or the one line that says how to get it."""
    try:
        import imagecodecs
    except ImportError:
        raise ConfigError("JPEG XL images need imagecodecs: pip install 'loadopt[jxl]'") from None
    if not hasattr(imagecodecs, "jpegxl_decode_jpeg") or not imagecodecs.JPEGXL.available:
        raise ConfigError(f"imagecodecs {imagecodecs.__version__} has no JPEG XL transcoding: pip install -U "
                          "'loadopt[jxl]'")
    return imagecodecs


def is_jxl(data: bytes | bytearray | memoryview) -> bool:
    head = bytes(data[:12])
    return head.startswith(JXL_CODESTREAM) or head == JXL_CONTAINER


def recompress_jpeg(data: bytes) -> bytes | None:
    """`data` (a JPEG) as JPEG XL, or None where that saves nothing or would not give back these bytes."""
    imagecodecs = codec()
    try:
        packed = imagecodecs.jpegxl_encode_jpeg(data, numthreads=1)
    except Exception:  # noqa: BLE001 - a JPEG libjxl cannot take (progressive oddities, damage) stays as it is
        return None
    if len(packed) >= len(data) or imagecodecs.jpegxl_decode_jpeg(packed, numthreads=1) != data:
        return None
    return bytes(packed)


def decodable(data: bytes) -> bytes:
    """The JPEG a recompressed JPEG was made from; any other bytes as they are."""
    if not is_jxl(data):
        return data
    try:
        # one thread: the loaders decode in several processes already
        return codec().jpegxl_decode_jpeg(bytes(data), numthreads=1)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - no JPEG inside (made from pixels): decode_pixels decodes it
        return data


def decode_pixels(data: bytes | bytearray | memoryview) -> np.ndarray:
    """A JPEG XL image made from pixels, as HWC uint8 RGB."""
    pixels = np.asarray(codec().jpegxl_decode(bytes(data), numthreads=1))
    if pixels.dtype.kind == "f":  # float samples run 0..1
        pixels = (np.clip(pixels, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    elif pixels.dtype != np.uint8:  # high bit depth: scaled to 8 bits
        pixels = (pixels.astype(np.float32) * (255.0 / np.iinfo(pixels.dtype).max)).round().astype(np.uint8)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.shape[2] == 1:
        pixels = np.repeat(pixels, 3, axis=2)
    return np.ascontiguousarray(pixels[:, :, :3])
