"""Crops of stored pixels: the native batch crops (loadopt/_native.c) against a numpy reference, and the
whole-frame crop + resize + flip (`crops.crop_frames`) fused against unfused: the same pixels."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from loadopt.loaders import crops


def frames_batch(count: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """`count` whole frames of assorted sizes in one buffer: (sources, starts, frames (h, w, source h, source w))."""
    rng = np.random.default_rng(seed)
    dims = [(int(rng.integers(40, 120)), int(rng.integers(40, 120))) for _ in range(count)]
    starts = np.cumsum([0] + [h * w * 3 for h, w in dims])[:-1].astype(np.int64)
    pixels = rng.integers(0, 256, sum(h * w * 3 for h, w in dims), dtype=np.uint8)
    frames = np.asarray([(h, w, 2 * h, 2 * w) for h, w in dims], np.int32)
    return [pixels], starts, frames


@pytest.mark.parametrize("augment", ["train", "eval"])
def test_fused_crop_frames_equal_unfused(augment):
    """The fused path (resize into the slot; a flipped crop resized into a scratch and mirrored by OpenCV)
    gives the unfused path's pixels (resize, flip, copy), flipped or not."""
    count, size = 12, 32
    sources, starts, frames = frames_batch(count)
    indices, which = np.arange(count), np.zeros(count, np.int32)
    _, flips = crops.frame_boxes(indices, frames, augment, 3, 1)
    if augment == "train":
        assert 0 < flips.sum() < count  # both kinds of sample
    fused, unfused = (np.zeros((count, size, size, 3), np.uint8) for _ in range(2))
    with ThreadPoolExecutor(2) as pool:
        crops.crop_frames(fused, indices, sources, which, starts, frames, augment, 3, 1, pool, 2, fused=True)
        crops.crop_frames(unfused, indices, sources, which, starts, frames, augment, 3, 1, pool, 2, fused=False)
    assert np.array_equal(fused, unfused)


@pytest.mark.skipif(crops.native is None, reason="loadopt._native is not built here")
@pytest.mark.parametrize("size", [224, 30])  # rows a multiple of 32 bytes, and not of 16
def test_native_crop_batch_equals_numpy(size):
    rng = np.random.default_rng(1)
    stored, count = size + 9, 8
    images = [rng.integers(0, 256, (stored, stored, 3), dtype=np.uint8) for _ in range(3)]
    which = rng.integers(0, 3, count).astype(np.int32)
    tops, lefts = rng.integers(0, stored - size + 1, count), rng.integers(0, stored - size + 1, count)
    flips = (np.arange(count) % 2).astype(np.uint8)
    offsets = crops.crop_offsets(np.zeros(count, np.int64), tops, lefts, stored)
    out = np.zeros((count, size, size, 3), np.uint8)
    crops.native.crop_batch(out, images, which, offsets, flips, stored * 3, size, 0, count, 2)
    for k in range(count):
        want = images[which[k]][tops[k] : tops[k] + size, lefts[k] : lefts[k] + size]
        assert np.array_equal(out[k], want[:, ::-1] if flips[k] else want), k


@pytest.mark.skipif(crops.native is None, reason="loadopt._native is not built here")
@pytest.mark.parametrize("check", [True, False])
def test_native_read_crops_from_mapped_files_equal_numpy(tmp_path, check):
    """Crops from read-only mappings of files, mincore checked per sample or not (`check`: then the threads'
    major faults are the misses): the numpy crops of the same bytes; nothing missed in a file just written."""
    import mmap
    import os

    rng = np.random.default_rng(2)
    stored, size, count = 40, 32, 10
    images = [rng.integers(0, 256, (6, stored, stored, 3), dtype=np.uint8) for _ in range(2)]
    maps, fds = [], []
    for s, pixels in enumerate(images):
        path = tmp_path / f"shard{s}"
        path.write_bytes(pixels.tobytes())
        fds.append(os.open(path, os.O_RDONLY))
        maps.append(mmap.mmap(fds[-1], 0, access=mmap.ACCESS_READ))
    try:
        which = rng.integers(0, 2, count).astype(np.int32)
        samples, tops, lefts = (rng.integers(0, n, count) for n in (6, stored - size + 1, stored - size + 1))
        flips = rng.integers(0, 2, count).astype(np.uint8)
        offsets = crops.crop_offsets(samples * stored * stored * 3, tops, lefts, stored)
        out = np.zeros((count, size, size, 3), np.uint8)
        misses, failed, _ = crops.native.read_crops(out, maps, np.asarray(fds, np.int32), which, offsets, flips,
                                                    stored * 3, size, 0, count, 2, check)
        assert (misses, failed) == (0, -1)
        for k in range(count):
            want = images[which[k]][samples[k], tops[k] : tops[k] + size, lefts[k] : lefts[k] + size]
            assert np.array_equal(out[k], want[:, ::-1] if flips[k] else want), k
    finally:
        for mapping in maps:
            mapping.close()
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("height, width", [(224, 224), (300, 333), (64, 17), (7, 5), (1, 1)])
def test_the_native_mirror_flips_each_row_in_place(height, width):
    from loadopt.imaging import resize

    if resize.native is None:
        pytest.skip("loadopt._native is not built (no C compiler when loadopt was installed)")
    pixels = np.random.default_rng(height * width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    mirrored = pixels.copy()
    resize.mirror_in_place(mirrored)
    assert np.array_equal(mirrored, pixels[:, ::-1])
    with pytest.raises(ValueError, match="mirror: out holds"):
        resize.native.mirror(mirrored, height + 1, width)
