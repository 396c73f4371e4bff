"""The `ffcv` peer backend: an FFCV .beton file (JPEG or raw pixels) read by FFCV's own Loader.

Conversion: FFCV's `DatasetWriter` with an `RGBImageField` (`form: jpg` re-encodes each decoded image
as FFCV does; `raw` stores the pixels), longer side at most `pipeline.max_side` (FFCV's
`max_resolution`), a label and the sample's index. Each epoch is FFCV's ImageNet example pipeline:
`RandomResizedCropRGBImageDecoder` (train; `CenterCropRGBImageDecoder` for eval), `RandomHorizontalFlip`,
`ToTensor`, `ToTorchImage`, in FFCV's threads (`num_workers`) with its order (`order: random` or
`quasi_random`, seeded). FFCV takes no Python transform, so the crops are its own: same scale and ratio
ranges as loadopt's plan, its own random draws and resize kernel; the recipe names that difference,
so the decision and `auto` never pick it for the config's recipe.

FFCV builds from source: a C compiler, OpenCV's development files (found by pkg-config) and
libturbojpeg; `available()` (and so `loadopt doctor`) says which of them this machine lacks. Written to
FFCV 1.0's documented API (its ImageNet example); run here in the peers' venv, where it builds.
Batches reach the harness as FFCV's NHWC pixels (layout "NHWC") in its own reused buffers (borrowed).
"""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from loadopt.imaging.decode import decode_array
from loadopt.imaging.geometry import EVAL_CROP_FRACTION
from loadopt.loaders.base import Layout, WorkKind
from loadopt.loaders.peers.base import (
    ConversionMeta,
    ConversionSettings,
    PeerLoader,
    PeerSettings,
    Skipped,
    epoch_seed,
    install_hint,
    library_available,
    source_samples,
)
from loadopt.loaders.peers.batches import PeerBatch
from loadopt.recipe import Recipe

FFCV_TRAIN_CROP = "FFCV RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3, FFCV's own draws and kernel) + flip"
FFCV_EVAL_CROP = "FFCV centre crop (ratio 224/256)"


class FfcvSettings(PeerSettings):
    form: Literal["jpg", "raw"] = "jpg"
    order: Literal["random", "quasi_random"] = "random"
    jpeg_quality: int = Field(90, ge=1, le=100)  # form jpg: FFCV re-encodes every image
    os_cache: bool = True  # FFCV reads the file through the page cache (False: its own process cache)

    @property
    def reencoded_quality(self) -> int | None:
        """The JPEG quality FFCV re-encodes every image at (`form: jpg`); None: it stores raw pixels."""
        return self.jpeg_quality if self.form == "jpg" else None


def build_requirements() -> list[str]:
    """What building FFCV needs that this machine lacks (empty: all found)."""
    missing = []
    if not (shutil.which("cc") or shutil.which("gcc")):
        missing.append("a C compiler (cc/gcc)")
    if not shutil.which("pkg-config"):
        missing.append("pkg-config")
    else:
        found = [name for name in ("opencv4", "opencv") if subprocess.run(
            ["pkg-config", "--exists", name], capture_output=True).returncode == 0]
        if not found:
            missing.append("OpenCV development files found by pkg-config (e.g. apt install libopencv-dev)")
    if ctypes.util.find_library("turbojpeg") is None:
        missing.append("libturbojpeg (e.g. apt install libturbojpeg0-dev)")
    return missing


class _Indexed:
    """The source as FFCV's writer reads it: `(HWC uint8 pixels, label, index)` per position."""

    def __init__(self, samples: list[tuple[int, int, bytes]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> tuple[np.ndarray, int, int]:
        index, label, data = self.samples[position]
        return decode_array(data, "simplejpeg"), label, index


class FfcvLoader(PeerLoader[FfcvSettings]):
    name = "ffcv"
    module = "ffcv"
    dist = "ffcv"
    Settings = FfcvSettings

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._loader: Any = None  # FFCV's Loader (an untyped library), made on the first epoch

    @classmethod
    def available(cls) -> tuple[bool, str]:
        ok, reason = library_available(cls.module, cls.dist, install_hint("ffcv"))
        if ok:
            return ok, reason
        missing = build_requirements()
        needs = f"; building it here needs {', '.join(missing)}" if missing else ""
        return False, reason + needs

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list]:
        # FFCV's workers are threads in the consumer process; `form` is the stored form (like arrow's).
        return {"form": ["jpg", "raw"], "num_workers": [n for n in (1, 2, 4, 8, 16, 32) if n < cores] + [cores]}

    def conversion_settings(self) -> ConversionSettings:
        s = self.settings
        return {"form": s.form, "max_side": self.pipeline.max_side, "quality": s.reencoded_quality}

    def describe(self) -> str:
        return f"{self.settings.form} threads={self.settings.num_workers} order=ffcv ({self.settings.order})"

    @classmethod
    def work_kind(cls, settings, recipe=None) -> str:
        # raw: stored frames
        return WorkKind.JPEG_DECODE if settings.reencoded_quality is not None else WorkKind.CROP_RESIZE

    def recipe(self) -> Recipe:
        from loadopt import recipe

        crop = FFCV_TRAIN_CROP if self.pipeline.augment == "train" else FFCV_EVAL_CROP
        quality = self.settings.reencoded_quality
        stored = (f"FFCV JPEG q{quality} re-encoded, " if quality is not None else "") + \
            f"whole frame <= {self.pipeline.max_side} px"
        return {**recipe.delivered(self.pipeline, "whole", self.pipeline.max_side), "crop": crop, "stored": stored,
                "order": self.name}

    def _write(self, folder: Path, skipped: Skipped) -> ConversionMeta:
        from ffcv.fields import IntField, RGBImageField
        from ffcv.writer import DatasetWriter

        samples = list(source_samples(self.dataset, self.on_error, skipped))
        image = RGBImageField(write_mode=self.settings.form, max_resolution=self.pipeline.max_side,
                              jpeg_quality=self.settings.jpeg_quality)
        writer = DatasetWriter(str(folder / "data.beton"), {"image": image, "label": IntField(), "index": IntField()},
                               num_workers=max(1, self.settings.num_workers))
        writer.from_indexed_dataset(_Indexed(samples))
        return ConversionMeta(samples=len(samples))

    def _ffcv_loader(self):
        from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.loader import Loader as FfcvReader
        from ffcv.loader import OrderOption
        from ffcv.transforms import RandomHorizontalFlip, ToTensor, ToTorchImage
        from ffcv.transforms.common import Squeeze

        size = (self.pipeline.image_size, self.pipeline.image_size)
        if self.pipeline.augment == "train":
            image = [RandomResizedCropRGBImageDecoder(size), RandomHorizontalFlip()]
        else:
            image = [CenterCropRGBImageDecoder(size, ratio=EVAL_CROP_FRACTION)]
        pipelines = {"image": [*image, ToTensor(), ToTorchImage()],
                     "label": [IntDecoder(), ToTensor(), Squeeze()], "index": [IntDecoder(), ToTensor(), Squeeze()]}
        order = OrderOption.RANDOM if self.settings.order == "random" else OrderOption.QUASI_RANDOM
        return FfcvReader(str(self.path / "data.beton"), batch_size=self.pipeline.batch_size,
                          num_workers=max(1, self.settings.num_workers), order=order, os_cache=self.settings.os_cache,
                          drop_last=self.pipeline.drop_last, pipelines=pipelines, seed=epoch_seed(self.seed, 0),
                          batches_ahead=self.settings.prefetch_factor)

    def ffcv_batches(self, epoch: int) -> Generator[tuple[torch.Tensor, torch.Tensor, torch.Tensor], None, None]:
        """FFCV's own epoch `epoch`: its (images, labels, indices) in its reused buffers, the images an NCHW
        view of NHWC memory (`ToTorchImage`'s channels_last)."""
        if self.path is None:
            self.prepare()
        if self._loader is None:
            self._loader = self._ffcv_loader()
        self._loader.next_epoch = epoch  # FFCV's order is drawn from (seed, epoch)
        epoch_iterator = iter(self._loader)  # FFCV's reading thread for this epoch
        try:
            yield from epoch_iterator
        finally:  # an epoch broken off: its thread stops now, not when the iterator is collected
            epoch_iterator.close()

    def library_batches(self, epoch: int) -> Generator[PeerBatch, None, None]:
        # FFCV reuses its batch buffers: a batch's slot is rewritten once the next batch is asked for. Its
        # pixels (NHWC) are handed over borrowed, as a training script hands them to its device, copied out
        # by the finishing before the next is asked for (`rebatch` copies what it keeps); on CUDA, where
        # that copy may still be in flight when FFCV moves on, copied here. Copying every batch would add a
        # third to FFCV raw's CPU per sample. Labels and indices: copied.
        borrow = self.device.type != "cuda"
        batches = self.ffcv_batches(epoch)
        try:
            for images, labels, indices in batches:
                pixels = images.permute(0, 2, 3, 1)
                yield {"inputs": pixels if borrow else pixels.clone(), "layout": "NHWC", "borrowed": borrow,
                       "labels": labels.to(torch.int64, copy=True), "indices": indices.to(torch.int64, copy=True),
                       "failures": []}
        finally:
            batches.close()

    def bare_batches(self, epoch: int) -> Generator[tuple[torch.Tensor, torch.Tensor, Layout], None, None]:
        # FFCV's loop as its ImageNet example iterates it: its buffers handed straight to the device
        batches = self.ffcv_batches(epoch)
        try:
            for images, labels, _ in batches:
                yield images.permute(0, 2, 3, 1), labels, "NHWC"
        finally:
            batches.close()

    def close(self) -> None:
        self._loader = None
