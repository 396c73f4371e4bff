"""The torch backend's DataLoader datasets for token windows and records (its image samples are the
loader's own): what a nanoGPT-style loader and DLIO's reader do, one window or record at a time;
and the batch its DataLoader hands the consumer (`WorkerBatch`)."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch
from typing_extensions import NotRequired, TypedDict

from loadopt.loaders.base import Layout
from loadopt.loaders.sample_transform import Made
from loadopt.storage.sources.records import RecordDataset
from loadopt.storage.sources.tokens import TokenDataset

# A sample asked of a torch dataset: (epoch, dataset index, ring slot of its batch; -1 for plain).
Item = tuple[int, int, int]
# A token window as `TokenWindows` gives it: (inputs, the inputs shifted by one, dataset index).
Window = tuple[torch.Tensor, torch.Tensor, int]


class WorkerBatch(TypedDict):
    """A batch as the torch backend's DataLoader hands it to the consumer, made in a worker (a dict: the
    DataLoader pins a dict's tensors on its way, as it would the user's)."""

    inputs: torch.Tensor
    labels: torch.Tensor | None  # None: records, which carry none (made by the consumer)
    indices: np.ndarray  # int64 dataset indices of the samples in `inputs`
    failures: list[tuple[int, str]]  # (index, reason) of the samples that failed
    layout: Layout
    normalised: bool
    bytes_read: NotRequired[int]  # records: the bytes read for them (an npz file is read whole)
    targets: NotRequired[Made | None]  # what a transform of (image, target) made of the samples' targets


class TokenWindows(torch.utils.data.Dataset):
    """Token windows sliced from the memory-mapped corpus, one per call: what nanoGPT-style loaders do."""

    def __init__(self, dataset: TokenDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: Item) -> Window:
        window = torch.from_numpy(self.dataset.window(item[1]).astype(np.int64))
        return window[:-1], window[1:], item[1]


class RecordSamples(torch.utils.data.Dataset):
    """Records read one at a time straight into their batch's row, each delivered as its first
    `delivered_bytes` bytes, with the bytes read for them (an npz file is read whole).

    `__getitems__` fills the batch in shared memory as it reads (as `default_collate`'s stack does in a
    worker), so one record's storage buffer is alive at a time (`RecordDataset.read_into`), and the batch
    is one tensor through the queue: labels (records carry none) are made by the consumer, not passed as
    a second shared-memory tensor (a second file descriptor handed over per batch)."""

    def __init__(self, dataset: RecordDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, items: list[Item]) -> WorkerBatch:
        wanted = self.dataset.delivered_bytes
        inputs = batch_memory(len(items), wanted)
        rows = inputs.numpy()
        read = sum(self.dataset.read_into(item[1], rows[k]) for k, item in enumerate(items))
        return {"inputs": inputs, "labels": None, "indices": np.asarray([item[1] for item in items], dtype=np.int64),
                "failures": [], "layout": "records", "normalised": True, "bytes_read": read}


def batch_memory(count: int, width: int) -> torch.Tensor:
    """A (count, width) uint8 batch: in a worker, in shared memory from the start (what `default_collate`
    does there, with the same torch call), so sending it to the consumer copies nothing."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty((count, width), dtype=torch.uint8)
    storage = torch.UntypedStorage._new_shared(count * width)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(count, width)


BatchT = TypeVar("BatchT")


def collated(batch: BatchT) -> BatchT:
    """The batch a dataset's `__getitems__` made (records, the tuned images): the DataLoader hands its
    collate function what that returned."""
    return batch


def collate_windows(samples: list[Window]) -> WorkerBatch:
    return {"inputs": torch.stack([s[0] for s in samples]), "labels": torch.stack([s[1] for s in samples]),
            "indices": np.asarray([s[2] for s in samples], dtype=np.int64), "failures": [], "layout": "tokens",
            "normalised": True}
