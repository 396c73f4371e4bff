"""The encoded forms' restart markers (`loadopt/_jpeg.c`'s `with_restarts`, `imaging.reencode.with_restarts`):
the same coefficients, so the same pixels bit for bit; a region of such a JPEG decoded from the intervals
around it only (the others never read) equals the full decode's crop; what cannot be transcoded is kept."""

import io

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from loadopt.imaging import decode, reencode

from .test_transforms import SAMPLINGS, encode, needs_region, photo

INTERVAL = reencode.RESTART_INTERVAL_PX


def grey_jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(photo(width, height)[..., 0]).save(out, format="JPEG", quality=90)
    return out.getvalue()


def first_interval(data: bytes) -> tuple[int, int]:
    """[start, end) of the first restart interval's entropy-coded bytes."""
    sos = data.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    return start, data.index(b"\xff\xd0", start)


def random_boxes(width: int, height: int, count: int, rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
    boxes = [(0, 0, width, height), (width - 1, height - 1, width, height), (0, height // 2, 3, height)]
    for _ in range(count):
        left, top = int(rng.integers(0, width - 1)), int(rng.integers(0, height - 1))
        boxes.append((left, top, int(rng.integers(left + 1, width + 1)), int(rng.integers(top + 1, height + 1))))
    return boxes


@needs_region
@pytest.mark.parametrize("sampling", list(SAMPLINGS) + ["grey"])
@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("size", [(517, 333), (368, 200)])  # 368 px at 4:2:0: 23 MCUs a row, one interval each
def test_restarts_keep_every_pixel_and_regions_equal_the_full_decodes_crop(sampling, progressive, size):
    width, height = size
    if sampling == "grey":
        if progressive:
            pytest.skip("the grey case is baseline only")
        source = grey_jpeg(width, height)
    else:
        source = encode(photo(width, height, 3), sampling, progressive)
    stored = decode.jpeg_region.with_restarts(source, INTERVAL)
    assert stored is not None and b"\xff\xdd" in stored and b"\xff\xd0" in stored  # a DRI segment, markers
    full = simplejpeg.decode_jpeg(source, colorspace="RGB")
    assert np.array_equal(simplejpeg.decode_jpeg(stored, colorspace="RGB"), full)  # lossless
    rng = np.random.default_rng(7)
    for left, top, right, bottom in random_boxes(width, height, 40, rng):
        region = decode.jpeg_region.decode_region(stored, 1, left, top, right, bottom)
        got = np.frombuffer(region, np.uint8).reshape(bottom - top, right - left, 3)
        assert np.array_equal(got, full[top:bottom, left:right]), (left, top, right, bottom)
    for denom in (2, 4, 8):  # reduced DCT scales: the source's own region decode's pixels
        scaled = (-(-width // denom), -(-height // denom))
        for box in random_boxes(*scaled, 10, rng):
            assert decode.jpeg_region.decode_region(stored, denom, *box) == \
                decode.jpeg_region.decode_region(source, denom, *box), (denom, box)


@needs_region
def test_a_region_below_the_first_interval_never_reads_it():
    """Zeroing the first interval's bytes (the top-left MCUs) leaves a region far from it as it was: those
    bytes are not read. The same region of a row-skipping-only decode (no markers) would read them."""
    source = encode(photo(517, 333, 5))
    stored = decode.jpeg_region.with_restarts(source, INTERVAL)
    start, end = first_interval(stored)
    damaged = stored[:start] + bytes(end - start) + stored[end:]
    full = simplejpeg.decode_jpeg(source, colorspace="RGB")
    far = (300, 200, 400, 300)
    region = np.frombuffer(decode.jpeg_region.decode_region(damaged, 1, *far), np.uint8).reshape(100, 100, 3)
    assert np.array_equal(region, full[200:300, 300:400])
    near = (0, 0, 40, 40)  # inside the zeroed interval: its pixels change (or the decoder stops at the damage)
    try:
        changed = decode.jpeg_region.decode_region(damaged, 1, *near) != full[:40, :40].tobytes()
    except ValueError:
        changed = True
    assert changed


@needs_region
def test_what_cannot_be_transcoded_is_kept_as_it_is():
    png, cmyk = io.BytesIO(), io.BytesIO()
    Image.fromarray(photo(40, 30)).save(png, format="PNG")
    Image.fromarray(photo(40, 30)).convert("CMYK").save(cmyk, format="JPEG")
    good = encode(photo(64, 48))
    for data in (png.getvalue(), cmyk.getvalue(), good[: len(good) // 2], b"\xff\xd8 not a jpeg"):
        assert decode.jpeg_region.with_restarts(data, INTERVAL) is None
        assert reencode.with_restarts(data) == data
    assert reencode.with_restarts(good) == decode.jpeg_region.with_restarts(good, INTERVAL)
