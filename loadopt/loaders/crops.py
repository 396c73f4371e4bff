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

import numpy as np
import torch

from loadopt.imaging.resize import MIRROR_IN_PLACE, crop_resize_flip_into, mirror_in_place, resize_aa
from loadopt.loaders import transforms
from loadopt.loaders.transforms import Augment

try:  # streaming stores and a 16-pixel mirror, built at install where a C compiler is
    from loadopt import _native as native
except ImportError:  # pragma: no cover - built by `pip install`; the paths below stay for installs without it
    native = None  # type: ignore[assignment]  # None where the optional module is absent

try:  # OpenCV's SIMD mirror: several times faster than numpy's byte `take` for a crop's flip
    import cv2
except ImportError:  # pragma: no cover - a dependency; the numpy path stays for installs without it
    cv2 = None  # type: ignore[assignment]  # None where the optional module is absent


def plan_crops(indices: np.ndarray, span: int, augment: Augment, seed: int,
               epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tops, lefts, flips) for a batch of samples, `span` = stored size - output size."""
    if augment != "train":  # eval's centre (and `none`: no random crop)
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

    Native (`loadopt._native`, where it was built): every row written with streaming stores, mirrored 16
    pixels at a time, so a batch's crops approach the memory copy rate (`benchmarks/arrow_ceiling.py`), where
    ordinary stores first read every line of the batch from memory (it is far larger than the cache): a
    third more memory traffic.
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
               starts: np.ndarray, stored: int, augment: Augment, seed: int, epoch: int, pool,
               threads: int) -> None:
    """Crop every sample of a batch into `out` (B, size, size, 3) by the shared plan: position k's
    `stored` x `stored` HWC image starts at byte `starts[k]` of `sources[which[k]]`. The samples are
    split over `threads` threads of `pool` (see `copy_crops`)."""
    size = out.shape[1]
    tops, lefts, flips = plan_crops(indices, stored - size, augment, seed, epoch)
    offsets = crop_offsets(starts, tops, lefts, stored)
    which32, flags = np.asarray(which, np.int32), flips.astype(np.uint8)
    if native is not None:  # one call, its threads in C: no GIL hand-over per chunk, which costs rate
        native.crop_batch(out, sources, which32, offsets, flags, stored * 3, size, 0, len(indices), threads)
        return
    chunks = [c for c in np.array_split(np.arange(len(indices)), min(threads, len(indices))) if len(c)]
    list((pool.map if pool is not None else map)(  # no pool: in this thread (one request's crop)
        lambda c: copy_crops(out, sources, which32, offsets, flags, stored * 3, int(c[0]), int(c[-1]) + 1), chunks))


# Under OpenMP, torch.set_num_threads in a thread sets that thread's team size only (the pool threads'
# resizes then never spawn teams that oversubscribe the cores the pool already fills); elsewhere it is global.
ONE_TORCH_THREAD_EACH = "OpenMP" in torch.__config__.parallel_info()


def frame_boxes(indices: np.ndarray, frames: np.ndarray, augment: Augment, seed: int,
                epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(boxes, flips) of a batch of whole frames: `frames[k]` = (height, width, source height, source
    width) of sample `indices[k]`; boxes (B, 4) = whole stored pixels (left, top, right, bottom), at
    least one pixel wide and high. The box is the JPEG paths' plan on the source size, scaled
    (vectorised: `transforms.plan_batch`)."""
    dims = np.asarray(frames, np.int64).reshape(len(indices), 4)
    height, width, source_height, source_width = dims.T
    boxes, flips = transforms.plan_batch(source_width, source_height, augment, seed, epoch, indices)
    sx, sy = width / source_width, height / source_height
    left = np.minimum(np.rint(boxes[:, 0] * sx), width - 1)
    top = np.minimum(np.rint(boxes[:, 1] * sy), height - 1)
    right = np.minimum(np.maximum(np.rint(boxes[:, 2] * sx), left + 1), width)
    bottom = np.minimum(np.maximum(np.rint(boxes[:, 3] * sy), top + 1), height)
    return np.stack([left, top, right, bottom], axis=1).astype(np.int64), flips


def crop_frames(out: np.ndarray, indices: np.ndarray, sources: Sequence[np.ndarray], which: np.ndarray,
                starts: np.ndarray, frames: np.ndarray, augment: Augment, seed: int, epoch: int,
                pool, threads: int, fused: bool = True,
                planned: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Crop, resize and flip every whole frame of a batch into `out` (B, size, size, 3) uint8: position
    k's (height, width, 3) frame starts at byte `starts[k]` of `sources[which[k]]`, its dims in
    `frames[k]` (see `frame_boxes`). torch's antialiased bilinear uint8 kernel (`imaging.resize`, the
    `torch` tuned path's), the GIL released; the samples split over `threads` threads of `pool`.
    `fused`: each crop resized straight into its HWC slot, a flipped one then mirrored where it lies
    (`mirror_in_place`): torch's kernel writes an HWC target faster than a new tensor (it returns NCHW,
    which then costs a transposing copy into the HWC slot), so the flipped half of the samples does not take
    the unfused path's time. `planned`: the batch's `frame_boxes`, drawn beforehand (a producer draws the next
    batch's while this one is cropped)."""
    boxes, flips = planned if planned is not None else frame_boxes(indices, frames, augment, seed, epoch)
    slots = torch.from_numpy(out).permute(0, 3, 1, 2)  # CHW views of the HWC slots
    mirror = fused and MIRROR_IN_PLACE and out.flags.c_contiguous  # a contiguous slot is mirrored where it lies
    # Memory-mapped frames are read-only; torch only reads them here (its warning would say otherwise).
    warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
    # Python values once per batch, not numpy scalars per sample: with 2 threads sharing one GIL, every
    # microsecond of per-sample Python is a microsecond the other thread may wait for it.
    dims, places, sourced = np.asarray(frames)[:, :2].tolist(), np.asarray(starts).tolist(), np.asarray(which).tolist()
    box_rows, flip_rows, size = np.asarray(boxes).tolist(), np.asarray(flips).tolist(), list(out.shape[1:3])
    slot_views = slots.split(1)  # (1, 3, size, size) views of each slot

    def run(positions: np.ndarray) -> None:
        if ONE_TORCH_THREAD_EACH:  # each pool thread is one core's worth: no OpenMP team of its own per resize
            torch.set_num_threads(1)
        flat: dict[int, torch.Tensor] = {}  # each source's bytes, as a tensor the crops are strided views of
        for k in positions.tolist():
            (height, width), (left, top, right, bottom), source = dims[k], box_rows[k], sourced[k]
            if not (fused and (mirror or not flip_rows[k])):  # the general path: a flip torch copies
                pixels = np.asarray(sources[source])[places[k]: places[k] + height * width * 3]
                crop_resize_flip_into(pixels.reshape(height, width, 3), (left, top, right, bottom), flip_rows[k],
                                      slots[k], fused)
                continue
            if source not in flat:
                flat[source] = torch.from_numpy(np.asarray(sources[source]).reshape(-1))
            # The crop's NCHW view in one call (bounds checked against the source by torch).
            crop = torch.as_strided(flat[source], (1, 3, bottom - top, right - left),
                                    (height * width * 3, 1, width * 3, 3), places[k] + (top * width + left) * 3)
            resize_aa(crop, size, slot_views[k])
            if flip_rows[k]:  # the same pixels: resized unflipped, then mirrored where they lie
                mirror_in_place(out[k])

    chunks = [c for c in np.array_split(np.arange(len(indices)), min(threads, len(indices))) if len(c)]
    list((pool.map if pool is not None else map)(run, chunks))  # no pool: in this thread (one request's crop)
