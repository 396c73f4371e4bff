"""Crops of pre-decoded HWC images, shared by the backends that store decoded pixels.

Two stored forms (see `loadopt.recipe`):
- whole frames (`frames`, the default for `augment: train`): each sample's whole frame, longer side at
  most `pipeline.max_side`. The crop plan is the JPEG paths' own (`transforms.plan` on the SOURCE
  image's width and height: RandomResizedCrop box + flip, or the eval centre box), scaled into stored
  pixels and rounded to whole ones (within half a stored pixel of the source box), then resized with
  the `torch` tuned path's kernel: where a frame is stored at its source size, the pixels equal the
  JPEG paths' (`frame_boxes`, `crop_frames`).
- centre squares (`decoded`): the shorter side resized to `stored`, centre-cropped; a random
  `size` crop + flip without resize for train (`sample_hash`), the centre for eval: exactly the eval
  recipe, a different one for train (the borders are gone). Plain copies (`plan_crops`, `crop_batch`).
Both plans depend only on (seed, epoch, index), so every backend crops a sample the same way.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from loadopt.imaging.resize import crop_resize_flip_into
from loadopt.loaders import transforms

try:  # streaming stores and a 16-pixel mirror (loadopt/_native.c), built at install where a C compiler is
    from loadopt import _native as native
except ImportError:  # pragma: no cover - built by `pip install`; the paths below stay for installs without it
    native = None  # type: ignore[assignment]  # None where the optional module is absent

try:  # OpenCV's SIMD mirror: 12 us per 224 px crop here, against 74 us for the byte `take`
    import cv2
except ImportError:  # pragma: no cover - a dependency; the numpy path stays for installs without it
    cv2 = None  # type: ignore[assignment]  # None where the optional module is absent


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
    if native is not None:  # one call, its threads in C: no GIL hand-over per chunk (a fifth of the rate here)
        native.crop_batch(out, sources, which32, offsets, flags, stored * 3, size, 0, len(indices), threads)
        return
    chunks = [c for c in np.array_split(np.arange(len(indices)), min(threads, len(indices))) if len(c)]
    list(pool.map(lambda c: copy_crops(out, sources, which32, offsets, flags, stored * 3, int(c[0]), int(c[-1]) + 1),
                  chunks))


# Under OpenMP, torch.set_num_threads in a thread sets that thread's team size only (the pool threads'
# resizes then never spawn teams that oversubscribe the cores the pool already fills); elsewhere it is global.
ONE_TORCH_THREAD_EACH = "OpenMP" in torch.__config__.parallel_info()


def frame_boxes(indices: np.ndarray, frames: np.ndarray, augment: Literal["train", "eval"], seed: int,
                epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(boxes, flips) of a batch of whole frames: `frames[k]` = (height, width, source height, source
    width) of sample `indices[k]`; boxes (B, 4) = whole stored pixels (left, top, right, bottom), at
    least one pixel wide and high. The box is the JPEG paths' plan on the source size, scaled."""
    boxes = np.empty((len(indices), 4), np.int64)
    flips = np.zeros(len(indices), bool)
    for k, index in enumerate(indices):
        height, width, source_height, source_width = (int(v) for v in frames[k])
        box, flips[k] = transforms.plan(source_width, source_height, augment, seed, epoch, int(index))
        sx, sy = width / source_width, height / source_height
        left, top = min(round(box[0] * sx), width - 1), min(round(box[1] * sy), height - 1)
        right, bottom = max(round(box[2] * sx), left + 1), max(round(box[3] * sy), top + 1)
        boxes[k] = (left, top, min(right, width), min(bottom, height))
    return boxes, flips


def crop_frames(out: np.ndarray, indices: np.ndarray, sources: Sequence[np.ndarray], which: np.ndarray,
                starts: np.ndarray, frames: np.ndarray, augment: Literal["train", "eval"], seed: int, epoch: int,
                pool, threads: int, fused: bool = True,
                planned: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Crop, resize and flip every whole frame of a batch into `out` (B, size, size, 3) uint8: position
    k's (height, width, 3) frame starts at byte `starts[k]` of `sources[which[k]]`, its dims in
    `frames[k]` (see `frame_boxes`). torch's antialiased bilinear uint8 kernel (`imaging.resize`, the
    `torch` tuned path's), the GIL released; the samples split over `threads` threads of `pool`.
    `fused`: each crop resized straight into its slot (`crop_resize_flip_into`); a flipped one resized into
    an HWC scratch of the thread's and mirrored from there into its slot by OpenCV. Profiled (224 px, one
    thread): torch's kernel writes an HWC target in 190 us, a new tensor in 290 us (it returns NCHW), which
    then costs a transposing copy into the HWC slot (125 us): the flipped half of the samples took the
    unfused path's time. `planned`: the batch's `frame_boxes`, drawn beforehand (a producer draws the next
    batch's while this one is cropped)."""
    boxes, flips = planned if planned is not None else frame_boxes(indices, frames, augment, seed, epoch)
    slots = torch.from_numpy(out).permute(0, 3, 1, 2)  # CHW views of the HWC slots
    mirror = fused and cv2 is not None and out.flags.c_contiguous  # cv2.flip writes into a contiguous slot only
    # Memory-mapped frames are read-only; torch only reads them here (its warning would say otherwise).
    warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)

    def run(positions: np.ndarray) -> None:
        if ONE_TORCH_THREAD_EACH:  # each pool thread is one core's worth: no OpenMP team of its own per resize
            torch.set_num_threads(1)
        scratch = np.empty(out.shape[1:], np.uint8)  # HWC, as a slot: a flipped crop resized here, then mirrored
        scratch_chw = torch.from_numpy(scratch).permute(2, 0, 1)
        for k in positions:
            height, width = int(frames[k][0]), int(frames[k][1])
            start = int(starts[k])
            pixels = np.asarray(sources[which[k]])[start : start + height * width * 3].reshape(height, width, 3)
            if mirror and flips[k]:  # the same pixels: resized unflipped, then mirrored
                crop_resize_flip_into(pixels, tuple(boxes[k]), False, scratch_chw)
                cv2.flip(scratch, 1, dst=out[k])
            else:
                crop_resize_flip_into(pixels, tuple(boxes[k]), bool(flips[k]), slots[k], fused)

    chunks = [c for c in np.array_split(np.arange(len(indices)), min(threads, len(indices))) if len(c)]
    list(pool.map(run, chunks))
