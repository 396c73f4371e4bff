"""A peer library's batch stream as loadopt's batches: the library's samples collated into `PeerBatch`es
(`collate`), and those cut into the batch sizes the base class planned (`rebatch`), copying only what
is kept past the library's next batch (`_Part.owned`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
from typing_extensions import NotRequired, TypedDict

from loadopt.loaders.base import HostBatch, Layout


class CroppedSample(NamedTuple):
    """One stored sample after the config's pipeline in a library's worker (`peer_base.CropSample`)."""

    pixels: torch.Tensor | None  # HWC uint8; None when the sample failed
    label: int
    dataset_index: int
    failure: str | None  # why the sample could not be decoded; None when it was


class PeerBatch(TypedDict):
    """One batch as a peer library's loader hands it over (a dict: it crosses the library's worker queues
    and pinning as one): `collate`'s, or one a library's own loop assembles (FFCV's)."""

    inputs: torch.Tensor  # uint8 pixels of the good samples, in `layout`
    labels: torch.Tensor  # int64
    indices: torch.Tensor  # int64 dataset indices of the good samples
    failures: list[tuple[int, str]]  # (index, reason) of the samples that failed
    layout: NotRequired[Layout]  # absent: NCHW
    borrowed: NotRequired[bool]  # a view of a buffer the library reuses at its next batch (FFCV's); absent: False


def collate(samples: list[CroppedSample]) -> PeerBatch:
    """A batch of `CropSample` results: uint8 NHWC inputs, labels, indices, and the samples that failed."""
    good = [s for s in samples if s.failure is None]
    pixels = [s.pixels for s in good if s.pixels is not None]  # all of the good ones'
    inputs = torch.stack(pixels) if pixels else torch.empty((0, 0, 0, 3), dtype=torch.uint8)
    return {"inputs": inputs, "layout": "NHWC", "labels": torch.tensor([s.label for s in good], dtype=torch.int64),
            "indices": torch.tensor([s.dataset_index for s in good], dtype=torch.int64),
            "failures": [(s.dataset_index, s.failure) for s in samples if s.failure is not None]}


# ---------------------------------------------------------------------------------------------
# In the consumer


@dataclass
class _Part:
    """What `rebatch` holds of one library batch and has not delivered yet; its failures count first."""

    inputs: torch.Tensor
    labels: torch.Tensor
    indices: torch.Tensor
    failures: list[tuple[int, str]]
    borrowed: bool

    @classmethod
    def of(cls, batch: PeerBatch) -> _Part:
        return cls(batch["inputs"], batch["labels"], batch["indices"], batch["failures"], batch.get("borrowed", False))

    def __len__(self) -> int:
        return len(self.indices) + len(self.failures)

    def split(self, count: int) -> tuple[_Part, _Part]:
        """The part's first `count` samples (its failures go with its first samples) and the rest."""
        good = max(0, count - len(self.failures))
        head = _Part(self.inputs[:good], self.labels[:good], self.indices[:good], self.failures[:count], self.borrowed)
        rest = _Part(self.inputs[good:], self.labels[good:], self.indices[good:], self.failures[count:], self.borrowed)
        return head, rest

    def owned(self) -> _Part:
        """This part with its pixels in memory of its own: a copy of a borrowed part's (a view of a buffer the
        library reuses when its next batch is asked for), the part itself otherwise."""
        return replace(self, inputs=self.inputs.clone(), borrowed=False) if self.borrowed else self


def rebatch(stream: Iterator[PeerBatch], sizes: list[int], skip: int = 0) -> Iterator[HostBatch]:
    """Cut the library's batches into batches of `sizes` samples (failed ones count), after dropping the
    first `skip` samples (a resumed epoch). A batch that already has the size passes through uncopied (a
    `borrowed` one as a borrowed HostBatch: finished before the next is asked for); what is kept of a
    borrowed one past a yield is copied before the library's next batch is asked for; the stream ending
    early ends the last batch short."""
    parts: list[_Part] = []
    have = 0
    layout: Layout = "NCHW"

    def take(count: int) -> HostBatch:
        nonlocal have
        chosen: list[_Part] = []
        left = count
        while left and parts:
            if len(parts[0]) <= left:
                chosen.append(parts.pop(0))
            else:
                head, parts[0] = parts[0].split(left)
                chosen.append(head)
            left -= len(chosen[-1])
        have -= count - left
        failures = [failure for part in chosen for failure in part.failures]
        if len(chosen) == 1:
            whole = chosen[0]
            inputs, labels, indices, borrowed = whole.inputs, whole.labels, whole.indices, whole.borrowed
        else:
            inputs = torch.cat([c.inputs for c in chosen])
            labels = torch.cat([c.labels for c in chosen])
            indices = torch.cat([c.indices for c in chosen])
            borrowed = False
        return HostBatch(inputs, labels, np.asarray(indices, np.int64), layout, normalised=False, failures=failures,
                         borrowed=borrowed)

    sizes = list(sizes)
    for batch in stream:
        layout = batch.get("layout", "NCHW")
        parts.append(_Part.of(batch))
        have += len(parts[-1])
        if skip:
            dropped = min(skip, have)
            take(dropped)
            skip -= dropped
        while sizes and have >= sizes[0]:
            yield take(sizes.pop(0))
        if not sizes:
            return
        parts = [p.owned() for p in parts]  # before the library's next batch reuses a borrowed buffer
    if sizes and have:
        yield take(have)
