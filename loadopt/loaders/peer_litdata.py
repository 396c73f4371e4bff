"""The `litdata` peer backend: LitData's optimized chunks and its own loop.

Conversion: the JPEG bytes, label and index of each sample in index order, in chunks of about
`chunk_mib` MiB written by LitData's `BinaryWriter` (what `litdata.optimize` writes with, here in
this process so that unreadable samples go by `on_error`). Each epoch is LitData's idiomatic loop: a
`litdata.StreamingDataset` over the local chunks, subclassed to run the config's pipeline in
`__getitem__` (`peer_base.CropSample`), shuffled by LitData with its `seed` from (seed, epoch),
batched by a `litdata.StreamingDataLoader` of `num_workers` processes. LitData reads its chunks
from the local disk itself, so it runs on the local tier only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import Field

from loadopt.loaders.peer_base import (
    CropSample,
    PeerLoader,
    PeerSettings,
    collate,
    epoch_seed,
    shutdown,
    source_samples,
)


class LitDataSettings(PeerSettings):
    chunk_mib: float = Field(32, gt=0)  # chunk size of the conversion


_classes: dict[str, type] = {}


def cropped_dataset_class() -> type:
    """A `litdata.StreamingDataset` whose `__getitem__` runs the config's pipeline (made on first use:
    LitData is optional; kept at module level under its name so that worker processes can find it)."""
    if "CroppedLitDataset" not in _classes:
        from litdata import StreamingDataset

        class CroppedLitDataset(StreamingDataset):
            def __init__(self, crop: CropSample, **kwargs: Any) -> None:
                super().__init__(**kwargs)
                self.crop = crop

            def __getitem__(self, index: Any) -> tuple:
                item = super().__getitem__(index)
                return self.crop(item["jpg"], int(item["idx"]), int(item["cls"]))

        CroppedLitDataset.__qualname__ = "CroppedLitDataset"
        globals()["CroppedLitDataset"] = CroppedLitDataset
        _classes["CroppedLitDataset"] = CroppedLitDataset
    return _classes["CroppedLitDataset"]


class LitDataLoader(PeerLoader):
    name = "litdata"
    module = "litdata"
    dist = "litdata"
    Settings = LitDataSettings
    settings: LitDataSettings

    def conversion_settings(self) -> dict[str, Any]:
        return {"chunk_mib": self.settings.chunk_mib}

    def describe(self) -> str:
        return f"chunks {self.settings.chunk_mib:g} MiB " + super().describe()

    def _write(self, folder: Path, skipped: list) -> dict[str, Any]:
        from litdata.streaming.writer import BinaryWriter

        writer = BinaryWriter(str(folder), chunk_bytes=int(self.settings.chunk_mib * 2**20))
        count = 0
        for index, label, data in source_samples(self.dataset, self.on_error, skipped):
            writer.add_item(count, {"jpg": data, "cls": label, "idx": index})
            count += 1
        writer.done()
        writer.merge()
        return {"samples": count}

    def dataset_for(self, epoch: int):
        """LitData's dataset for one epoch (its shuffle seeded by (seed, epoch))."""
        return cropped_dataset_class()(self.crop_sample(epoch), input_dir=str(self.path), shuffle=True,
                                       seed=epoch_seed(self.seed, epoch), drop_last=self.pipeline.drop_last)

    def library_batches(self, epoch: int) -> Iterator[dict[str, Any]]:
        from litdata import StreamingDataLoader

        if self.path is None:
            self.prepare()
        loader = StreamingDataLoader(self.dataset_for(epoch), batch_size=self.pipeline.batch_size, collate_fn=collate,
                                     **self.dataloader_options())
        iterator = iter(loader)
        try:
            yield from iterator
        finally:
            shutdown(iterator)
