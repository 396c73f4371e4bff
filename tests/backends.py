"""Test backends whose per-batch delays are known, over an in-memory dataset."""

from __future__ import annotations

import queue
import threading
import time

import fsspec
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from loadopt.config import PipelineConfig
from loadopt.loaders.base import HostBatch, Loader
from loadopt.storage.sources.imagefolder import ImageDataset


def memory_dataset(num_samples: int, sample_bytes: int = 1000) -> ImageDataset:
    return ImageDataset(root="memory://fake", fs=fsspec.filesystem("memory"),
                        paths=np.array([f"/fake/{i}.jpg".encode() for i in range(num_samples)]),
                        labels=np.arange(num_samples, dtype=np.int64) % 10,
                        sizes=np.full(num_samples, sample_bytes, dtype=np.int64), classes=[str(i) for i in range(10)],
                        fingerprint="fake")


class DelaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    delay_s: float = 0.01
    background: bool = True  # True: a producer thread with a prefetch queue (like DataLoader workers)
    prefetch: int = 2


class DelayLoader(Loader[DelaySettings]):
    """Produces each batch `delay_s` after the previous one (background) or on request (foreground).
    `made_s`: how long making each batch took (the delay as slept, which runs long on a busy machine)."""

    name = "delay"
    Settings = DelaySettings
    made_s: list[float]

    def _batch(self, indices: np.ndarray) -> HostBatch:
        inputs = torch.zeros((len(indices), 3, 8, 8))
        return HostBatch(inputs, torch.from_numpy(self.dataset.labels[indices]), indices)

    def _made(self, indices: np.ndarray, delay: float) -> HostBatch:
        began = time.perf_counter()
        time.sleep(delay)
        batch = self._batch(indices)
        self.made_s.append(time.perf_counter() - began)
        return batch

    def produce(self, batches):
        delay = self.settings.delay_s
        if not hasattr(self, "made_s"):
            self.made_s = []
        if not self.settings.background:
            for indices in batches:
                yield self._made(indices, delay)
            return
        ready: queue.Queue = queue.Queue(maxsize=self.settings.prefetch)
        stop = threading.Event()

        def produce():
            for indices in batches:
                batch = self._made(indices, delay)
                while not stop.is_set():
                    try:
                        ready.put(batch, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        try:
            for _ in batches:
                yield ready.get()
        finally:
            stop.set()
            thread.join()


def delay_loader(num_samples=4096, batch_size=16, rank=0, world_size=1, **settings) -> DelayLoader:
    # Its batches are NCHW already: asking for that layout keeps the finishing to the copy and the
    # normalisation, so the known delays, not a layout conversion, are what the tests measure.
    return DelayLoader(memory_dataset(num_samples), PipelineConfig(batch_size=batch_size, memory_format="contiguous"),
                       DelaySettings(**settings), rank=rank, world_size=world_size)


class PixelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = 32
    borrowed: bool = False  # True: one buffer, rewritten for every batch (a ring of one slot)


class PixelLoader(Loader[PixelSettings]):
    """uint8 NCHW batches at once, for the finishing to normalise: the same batch every time, or (borrowed)
    one buffer holding batch n's number n % 256, rewritten once the device's copy of the last is done."""

    name = "pixels"
    Settings = PixelSettings

    def produce(self, batches):
        size, n = self.settings.size, self.pipeline.batch_size
        generator = torch.Generator().manual_seed(0)
        buffer = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)
        previous = None
        for number, indices in enumerate(batches):
            labels = torch.from_numpy(self.dataset.labels[indices])
            if not self.settings.borrowed:
                yield HostBatch(buffer[: len(indices)], labels, indices, normalised=False)
                continue
            if previous is not None and previous.copy_done is not None:
                previous.copy_done.synchronize()
            buffer.fill_(number % 256)
            previous = HostBatch(buffer[: len(indices)], labels, indices, normalised=False, borrowed=True)
            yield previous


def pixel_loader(num_samples=4096, batch_size=16, **settings) -> PixelLoader:
    size = settings.get("size", PixelSettings().size)
    return PixelLoader(memory_dataset(num_samples), PipelineConfig(batch_size=batch_size, image_size=size),
                       PixelSettings(**settings))
