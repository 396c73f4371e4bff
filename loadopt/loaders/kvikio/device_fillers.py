"""The fillers of the `kvikio` backend: each stored form finished with torch ops on the device of the staging
buffer its bytes were read into (cuFile: GPU memory; the encoded forms' pinned host memory), into a ring
slot on that device. Same forms, slots and batches as the host fillers they subclass; every
step is plain torch, so the tests run them on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor

import numpy as np
import torch

from loadopt.errors import BackendUnavailable
from loadopt.imaging.resize import crop_resize_flip_chw
from loadopt.loaders import crops, transforms
from loadopt.loaders.fillers import (
    CentreSquares,
    EncodedJpegs,
    FillContext,
    Filled,
    Filler,
    Located,
    Records,
    TokenWindows,
    WholeFrames,
)
from loadopt.storage.forms.raw_format import align_up


def wait_for_readers(buffer: torch.Tensor) -> None:
    """Wait for the kernels reading the staging buffer: cuFile refills it next, outside the stream."""
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()


class DeviceCentreSquares(CentreSquares):
    """Views and one copy kernel per sample, no host round trip."""

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located, epoch: int,
             pool: Executor | None) -> Filled:
        stored, size = self.context.size, self.context.pipeline.image_size
        assert stored is not None, "centre squares are stored at a size"
        tops, lefts, flips = crops.plan_crops(indices, stored - size, self.context.pipeline.augment, self.context.seed,
                                              epoch)
        for k in range(len(indices)):
            pixels = located.bytes_of(k).view(stored, stored, 3)
            crop = pixels[tops[k] : tops[k] + size, lefts[k] : lefts[k] + size]
            slot[k].copy_(crop.flip(1) if flips[k] else crop)
        wait_for_readers(located.sources[0])
        return Filled(indices, [], located.nbytes)


class DeviceWholeFrames(WholeFrames):
    """The shared plan's box of each whole frame, resized and flipped on the device."""

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located, epoch: int,
             pool: Executor | None) -> Filled:
        frames = located.frames
        assert frames is not None, "whole frames are located with their dims"
        boxes, flips = crops.frame_boxes(indices, frames, self.context.pipeline.augment, self.context.seed, epoch)
        for k in range(len(indices)):
            height, width = int(frames[k][0]), int(frames[k][1])
            pixels = located.bytes_of(k)[: height * width * 3].view(height, width, 3)
            crop_resize_flip_chw(pixels.permute(2, 0, 1), tuple(boxes[k]), bool(flips[k]), slot[k].permute(2, 0, 1))
        wait_for_readers(located.sources[0])
        return Filled(indices, [], located.nbytes)


class DeviceJpegs(EncodedJpegs):
    """The encoded forms' JPEGs decoded in one batched call on the slot's device, then cropped, resized and
    flipped there by the plan every backend shares (`transforms.decode_batch`; a failing batch is decoded
    again sample by sample to name the bad ones). Every GPU JPEG decoder parses the bitstream on the host,
    so the bytes are read into (pinned) host memory (`bytes_on_host`)."""

    bytes_on_host = True

    def __init__(self, context: FillContext) -> None:
        super().__init__(context)
        found = context.device_decoder() if context.device_decoder is not None else (None, "no GPU decoder asked")
        if found[0] is None:
            raise BackendUnavailable(f"loaders.{context.backend}.form encoded: {found[1]}")
        self.decoder = found[0]

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located, epoch: int,
             pool: Executor | None) -> Filled:
        failures = transforms.decode_batch(slot, indices, located.bytes_of, self.decoder,
                                           self.context.pipeline.augment, self.context.seed, epoch)
        wait_for_readers(slot)  # the decoder may still copy bitstreams from this staging buffer asynchronously
        return Filled(indices, failures, located.nbytes)


class DeviceTokenWindows(TokenWindows):
    """Token windows cut from the staging buffer on its device (fixed-size windows, each at its aligned
    staging offset) and widened to int64 there."""

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located, epoch: int,
             pool: Executor | None) -> Filled:
        staging = located.sources[0]
        dtype = torch.from_numpy(np.zeros(0, self.tokens.tokens.dtype)).dtype
        width, n = int(located.lengths[0]), len(indices)
        stride = int(align_up(width))  # staging row r holds batch position order[r]
        windows = staging[: n * stride].view(n, stride)[:, :width].contiguous().view(dtype).long()
        order = torch.from_numpy(np.argsort(located.starts)).to(staging.device)
        slot[0][order], slot[1][order] = windows[:, :-1], windows[:, 1:]
        wait_for_readers(staging)
        return Filled(indices, [], located.nbytes)


class DeviceRecords(Records):
    """Each record's first bytes, zero-padded, copied on the staging buffer's device."""

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located, epoch: int,
             pool: Executor | None) -> Filled:
        for k in range(len(indices)):
            kept = min(int(located.lengths[k]), slot.shape[1])
            slot[k][:kept].copy_(located.bytes_of(k)[:kept])
            slot[k][kept:].zero_()
        wait_for_readers(located.sources[0])
        return Filled(indices, [], located.nbytes)


# The device filler of each stored form.
DEVICE_FILLERS: Mapping[str, type[Filler]] = {
    "decoded": DeviceCentreSquares, "frames": DeviceWholeFrames, "encoded": DeviceJpegs, "reencoded": DeviceJpegs,
    "tokens": DeviceTokenWindows, "records": DeviceRecords,
}
