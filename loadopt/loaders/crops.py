"""Crops of pre-decoded square HWC images, shared by the backends that store decoded pixels.

The plan (a random crop + flip for train from `sample_hash`, a centred crop for eval) depends only on
(seed, epoch, index), so every backend crops a sample the same way and their batches are equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from loadopt.loaders import transforms

try:  # streaming stores and a 16-pixel mirror (loadopt/_native.c), built at install where a C compiler is
    from loadopt import _native as native
except ImportError:  # pragma: no cover - built by `pip install`; the paths below stay for installs without it
    native = None

try:  # OpenCV's SIMD mirror: 12 us per 224 px crop here, against 74 us for the byte `take`
    import cv2
except ImportError:  # pragma: no cover - a dependency; the numpy path stays for installs without it
    cv2 = None


def plan_crops(indices: np.ndarray, span: int, augment: Literal["train", "eval"], seed: int,
               epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tops, lefts, flips) for a batch of samples, `span` = stored size - output size."""
    if augment == "eval":
        tops = lefts = np.full(len(indices), span // 2, dtype=np.int64)
        return tops, lefts, np.zeros(len(indices), dtype=bool)
    bits = transforms.sample_hash(seed, epoch, indices)
    tops = (bits % np.uint64(span + 1)).astype(np.int64)
    lefts = ((bits >> np.uint64(20)) % np.uint64(span + 1)).astype(np.int64)
    return tops, lefts, (bits >> np.uint64(63)).astype(bool)


def crop_offsets(starts: np.ndarray, tops: np.ndarray, lefts: np.ndarray, stored: int) -> np.ndarray:
    """Byte offsets of each crop's top-left pixel, from the offsets of the stored images."""
    return (np.asarray(starts, np.int64) + (tops * stored + lefts) * 3).astype(np.int64)


def copy_crops(out: np.ndarray, sources: Sequence[np.ndarray], which: np.ndarray, offsets: np.ndarray,
               flips: np.ndarray, stride: int, first: int, last: int) -> None:
    """Write positions [first, last) of `out` (B, size, size, 3), C-contiguous: position k is the
    size x size crop whose top-left pixel is at byte `offsets[k]` of the uint8 buffer `sources[which[k]]`,
    its rows `stride` bytes apart, mirrored left-right where `flips[k]`. Releases the GIL.

    Native (`loadopt/_native.c`, where it was built): every row written with streaming stores, mirrored 16
    pixels at a time; a batch's crops reach 0.8-1.0 of the memory copy rate here (2 threads,
    `bench/arrow_ceiling.py`), where ordinary stores first read every line of the batch from memory
    (it is far larger than the cache): a third more memory traffic, 0.4-0.6 of the copy rate.
    Otherwise one strided copy of the rows per crop, a flip by OpenCV's mirror (1.7x a plain copy),
    else a reversed `take` of the rows' bytes (pixel j's channels come from pixel size-1-j; 10x a copy)."""
    size = out.shape[1]
    if native is not None:
        native.crop_batch(out, sources, np.asarray(which, np.int32), np.asarray(offsets, np.int64),
                          np.asarray(flips, np.uint8), stride, size, first, last)
        return
    flat = [np.asarray(source).reshape(-1) for source in sources]
    reverse_bytes = (np.arange(size - 1, -1, -1)[:, None] * 3 + np.arange(3)[None, :]).reshape(-1)
    for k in range(first, last):
        start = int(offsets[k])
        crop = np.lib.stride_tricks.as_strided(flat[which[k]][start:], (size, size, 3), (stride, 3, 1))
        if flips[k] and cv2 is not None:
            cv2.flip(crop, 1, dst=out[k])
        elif flips[k]:
            rows = np.lib.stride_tricks.as_strided(flat[which[k]][start:], (size, size * 3), (stride, 1))
            np.take(rows, reverse_bytes, axis=1, out=out[k].reshape(size, size * 3))
        else:
            np.copyto(out[k], crop)


def crop_batch(out: np.ndarray, indices: np.ndarray, sources: Sequence[np.ndarray], which: np.ndarray,
               starts: np.ndarray, stored: int, augment: Literal["train", "eval"], seed: int, epoch: int, pool,
               threads: int) -> None:
    """Crop every sample of a batch into `out` (B, size, size, 3) by the shared plan: position k's
    `stored` x `stored` HWC image starts at byte `starts[k]` of `sources[which[k]]`. The samples are
    split over `threads` threads of `pool` (see `copy_crops`)."""
    size = out.shape[1]
    tops, lefts, flips = plan_crops(indices, stored - size, augment, seed, epoch)
    offsets = crop_offsets(starts, tops, lefts, stored)
    which32, flags = np.asarray(which, np.int32), flips.astype(np.uint8)
    chunks = [c for c in np.array_split(np.arange(len(indices)), min(threads, len(indices))) if len(c)]
    list(pool.map(lambda c: copy_crops(out, sources, which32, offsets, flags, stored * 3, int(c[0]), int(c[-1]) + 1),
                  chunks))
