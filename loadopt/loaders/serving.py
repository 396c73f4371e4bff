"""The request path of a backend (the inference scenarios, loadopt/serve/): from what a request carries to the
image the model takes, one request or one dynamic batch at a time.

A backend that can serve requests says so in `Loader.request_paths` (one path per way it serves, e.g. torch's
plain and tuned decoders); the others give the reason they cannot. Every path delivers the eval recipe
(the centre crop, resized to `pipeline.image_size`) as HWC uint8 images, finished (layout, normalisation) on the
device by the server, as the loaders' batches are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from loadopt.config_models import PipelineConfig
from loadopt.storage.dataset import Dataset

Payload = Any  # what a request carries: its stored bytes, or its sample id in a fixed catalogue


class RequestPath:
    """One backend's way of preprocessing requests. `per_batch` False: `one` runs per request in the server's
    worker threads (decoders that release the GIL); True: `batch` runs on each dynamic batch after the
    batcher (a library that works on batches, as DALI in Triton's ensembles)."""

    per_batch: ClassVar[bool] = False

    def __init__(self, label: str, pipeline: PipelineConfig, seed: int) -> None:
        self.label = label  # e.g. "torch tuned (region decode)": the row's name in the tables
        self.pipeline = pipeline
        self.seed = seed

    def open(self, dataset: Dataset, progress: Callable[[int, int], None] | None = None) -> None:  # noqa: B027
        """Make ready what the path reads (a conversion for a catalogue), before any request is timed."""

    def payload(self, dataset: Dataset, index: int) -> Payload:
        """What request `index` carries: by default the sample's stored bytes (read before the run, as LoadGen
        loads its query samples into memory first)."""
        return dataset.read(index)

    def new_image(self) -> torch.Tensor:
        size = self.pipeline.image_size
        return torch.empty((size, size, 3), dtype=torch.uint8)

    def one(self, payload: Payload) -> torch.Tensor:
        """One request's image: (size, size, 3) uint8."""
        raise NotImplementedError(f"{self.label} preprocesses whole batches")

    def batch(self, payloads: Sequence[Payload]) -> torch.Tensor:
        """A batch's images, (n, size, size, 3) uint8, on the host or already on the device."""
        return torch.stack([self.one(p) for p in payloads])

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what `open` made."""


class Unservable(Exception):
    """A backend that cannot serve requests, and why (listed as unavailable for the scenario)."""

