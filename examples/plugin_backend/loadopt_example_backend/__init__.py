"""An outside loadopt backend, written from docs/plugins.md: the source JPEGs decoded in a thread pool.

Each batch's samples are read with `dataset.read`, decoded, cropped and resized with the shared crop plan
(`transforms.write_sample`: the same pixels as loadopt's own JPEG paths) into a fresh uint8 NCHW batch,
normalised on the device by loadopt. `delay_ms` adds a known delay per batch on top of that work (an
emulated slow production step, to check that the stall and the attribution find it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from loadopt.loaders import HostBatch, Loader, WorkKind, transforms
from loadopt.schema import Recipe

__all__ = ["ThreadedJpegLoader", "ThreadedJpegSettings"]


class ThreadedJpegSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threads: int = Field(2, ge=1)  # decoding threads (simplejpeg and PIL release the GIL)
    delay_ms: float = Field(0.0, ge=0.0)  # injected per batch, on top of the work (testing only)


class ThreadedJpegLoader(Loader[ThreadedJpegSettings]):
    """Source JPEGs decoded with the shared crop plan in `threads` threads; one batch at a time."""

    Settings = ThreadedJpegSettings

    @classmethod
    def work_kind(cls, settings: ThreadedJpegSettings, recipe: Recipe | None = None) -> str:
        return WorkKind.JPEG_DECODE

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list]:
        return {"threads": sorted({1, max(1, cores // 2), cores})}

    @classmethod
    def cpu_demand(cls, settings: ThreadedJpegSettings) -> int:
        return settings.threads

    def produce(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        size, augment = self.pipeline.image_size, self.pipeline.augment
        decoder, epoch, seed = transforms.decoder_name("auto"), self.epoch, self.seed
        delay = self.settings.delay_ms / 1000.0

        def decode(out: torch.Tensor, position: int, index: int) -> str | None:
            try:
                transforms.write_sample(self.dataset.read(index), out[position], decoder, "torch", augment, seed,
                                        epoch, index)
                return None
            except Exception as exc:  # a corrupt or unreadable sample: reported, loadopt applies on_error
                return f"{type(exc).__name__}: {exc}"

        pool = ThreadPoolExecutor(self.settings.threads, thread_name_prefix="example-jpeg")
        try:
            for indices in batches:
                out = torch.empty((len(indices), 3, size, size), dtype=torch.uint8)
                reasons = list(pool.map(decode, [out] * len(indices), range(len(indices)), indices.tolist()))
                kept = np.asarray([reason is None for reason in reasons], dtype=bool)
                failures = [(int(i), reason) for i, reason in zip(indices, reasons, strict=True) if reason is not None]
                if delay:
                    time.sleep(delay)  # the injected delay: known, on top of the real work above
                labels = torch.from_numpy(self.dataset.labels[indices[kept]])
                inputs = out if kept.all() else out[torch.from_numpy(kept)]
                yield HostBatch(inputs, labels, indices[kept], layout="NCHW", normalised=False, failures=failures)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
