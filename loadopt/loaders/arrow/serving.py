"""The `arrow` backend's request path: a catalogue stored in its conversion, a request naming a sample id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from loadopt.config_models import PipelineConfig
from loadopt.loaders.arrow.column import ArrowColumn
from loadopt.loaders.fillers import Filler
from loadopt.loaders.serving import Payload, RequestPath
from loadopt.storage.dataset import Dataset


class Catalogue(Protocol):
    """What the catalogue reads through: the arrow loader, prepared on `open` (its conversion mapped)."""

    @property
    def filler(self) -> Filler[Any]: ...

    @property
    def column(self) -> ArrowColumn: ...

    def prepare(self, progress: Callable[[int, int], None] | None = None) -> None: ...

    def close(self) -> None: ...


class CatalogueRequests(RequestPath):
    """A fixed catalogue pre-decoded in the arrow backend's conversion: the request carries a sample id, the
    image is its stored form's eval crop (copied from the mapped file, or decoded from it for the encoded form)."""

    def __init__(self, label: str, pipeline: PipelineConfig, seed: int, loader: Catalogue) -> None:
        super().__init__(label, pipeline, seed)
        self.loader = loader

    def open(self, dataset: Dataset, progress: Callable[[int, int], None] | None = None) -> None:
        self.loader.prepare(progress)

    def payload(self, dataset: Dataset, index: int) -> Payload:
        return index

    def one(self, payload: Payload) -> torch.Tensor:
        indices = np.asarray([payload], dtype=np.int64)
        slot = self.new_image().unsqueeze(0)
        filled = self.loader.filler.fill(slot, indices, self.loader.column.locate(indices), 0, None)
        if filled.failures:
            raise ValueError(filled.failures[0][1])
        return slot[0]

    def close(self) -> None:
        self.loader.close()
