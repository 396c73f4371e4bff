"""Records (`dataset.kind: records`, storage/records.py) in the ring backends (posix, kvikio, arrow).

They read a conversion holding each record's stored bytes whole (`records` form of the raw shards and of
the Arrow file: a raw record's byte range, an npz file's record row), so every byte of a record is read
from storage, and deliver its first `delivered_bytes` (zero-padded: DLIO's `record_length_bytes_resize`)
into a ring of (batch, delivered_bytes) uint8 rows, as the `torch` backend delivers them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from loadopt.loaders.base import HostBatch, Layout
from loadopt.storage.dataset import Dataset
from loadopt.storage.records import RecordDataset

FORM = "records"  # the stored form of records in both conversions


def is_records(dataset: object) -> bool:
    return isinstance(dataset, RecordDataset)


def record_ring(slots: int, batch_size: int, dataset: RecordDataset, device: torch.device) -> list[torch.Tensor]:
    """`slots` uint8 batches of `delivered_bytes` rows (pinned on CUDA, for the asynchronous copy)."""
    ring = torch.empty((slots, batch_size, dataset.delivered_bytes), dtype=torch.uint8)
    return list(ring.pin_memory() if device.type == "cuda" else ring)


def deliver_rows(dataset: RecordDataset, out: np.ndarray, records: list[np.ndarray]) -> None:
    """Row k of `out` (uint8, (batch, delivered_bytes)): the first bytes of `records[k]`, zero-padded."""
    for row, record in zip(out, records, strict=False):
        dataset.deliver(record, row)


def record_batch(slot: torch.Tensor, indices: np.ndarray, bytes_read: int | None) -> HostBatch:
    """The host batch over a filled ring slot: its first len(indices) rows (records carry no labels)."""
    n = len(indices)
    return HostBatch(slot[:n], torch.zeros(n, dtype=torch.int64), indices, "records", normalised=True,
                     bytes_read=bytes_read, borrowed=True)


class RecordsInRing:
    """Mixed into a ring backend before `RingLoader` (`class PosixLoader(RecordsInRing, RingLoader[...])`):
    records are supported (read from the conversion's `records` form), laid out as `records`, in a ring of
    `record_ring`. The backend's fill and batch methods test `_records`."""

    dataset: Dataset
    device: torch.device
    pipeline: Any
    settings: Any
    stored_form: Any
    frame: Any
    size: int | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._records = is_records(self.dataset)
        if self._records:  # stored whole, delivered as their first bytes: no frame, no pixel size
            self.stored_form, self.frame, self.size = FORM, None, None

    @property
    def records(self) -> RecordDataset:
        """The dataset as record files (only where `_records`)."""
        assert isinstance(self.dataset, RecordDataset), "a records ring reads a RecordDataset"
        return self.dataset

    @classmethod
    def supports(cls, dataset: Dataset) -> tuple[bool, str]:
        if is_records(dataset):
            return True, ""  # converted to the records form
        return super().supports(dataset)  # type: ignore[misc]

    @property
    def layout(self) -> Layout:
        return "records" if self._records else super().layout  # type: ignore[misc]

    def _make_ring(self) -> list[torch.Tensor]:
        if self._records:
            return record_ring(self.settings.prefetch + 2, self.pipeline.batch_size, self.records, self.device)
        return super()._make_ring()  # type: ignore[misc]
