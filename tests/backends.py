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
from loadopt.storage.imagefolder import ImageDataset


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
    """Produces each batch `delay_s` after the previous one (background) or on request (foreground)."""

    name = "delay"
    Settings = DelaySettings

    def _batch(self, indices: np.ndarray) -> HostBatch:
        inputs = torch.zeros((len(indices), 3, 8, 8))
        return HostBatch(inputs, torch.from_numpy(self.dataset.labels[indices]), indices)

    def produce(self, batches):
        delay = self.settings.delay_s
        if not self.settings.background:
            for indices in batches:
                time.sleep(delay)
                yield self._batch(indices)
            return
        ready: queue.Queue = queue.Queue(maxsize=self.settings.prefetch)
        stop = threading.Event()

        def produce():
            for indices in batches:
                time.sleep(delay)
                while not stop.is_set():
                    try:
                        ready.put(self._batch(indices), timeout=0.05)
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
