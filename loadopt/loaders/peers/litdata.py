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

from collections.abc import Iterable
from pathlib import Path

from pydantic import Field

from loadopt.loaders.peers.base import (
    ConversionMeta,
    ConversionSettings,
    PeerLoader,
    PeerSettings,
    Skipped,
    cropped,
    epoch_seed,
    record,
    source_samples,
)
from loadopt.loaders.peers.batches import PeerBatch, collate


class LitDataSettings(PeerSettings):
    chunk_mib: float = Field(32, gt=0)  # chunk size of the conversion


class LitDataLoader(PeerLoader[LitDataSettings]):
    name = "litdata"
    module = "litdata"
    dist = "litdata"
    Settings = LitDataSettings

    def conversion_settings(self) -> ConversionSettings:
        return {"chunk_mib": self.settings.chunk_mib}

    def describe(self) -> str:
        return f"chunks {self.settings.chunk_mib:g} MiB " + super().describe()

    def _write(self, folder: Path, skipped: Skipped) -> ConversionMeta:
        from litdata.streaming.writer import BinaryWriter

        writer = BinaryWriter(str(folder), chunk_bytes=int(self.settings.chunk_mib * 2**20))
        count = 0
        for sample in source_samples(self.dataset, self.on_error, skipped):
            writer.add_item(count, record(*sample))
            count += 1
        writer.done()
        writer.merge()
        return ConversionMeta(samples=count)

    def library_loader(self, epoch: int) -> Iterable[PeerBatch]:
        """LitData's dataset for one epoch (its shuffle seeded by (seed, epoch)) in its DataLoader."""
        from litdata import StreamingDataLoader, StreamingDataset

        dataset = cropped(StreamingDataset, "CroppedLitDataset")(
            self.crop_sample(epoch), input_dir=str(self.path), shuffle=True, seed=epoch_seed(self.seed, epoch),
            drop_last=self.pipeline.drop_last)
        return StreamingDataLoader(dataset, batch_size=self.pipeline.batch_size, collate_fn=collate,
                                   **self.dataloader_options())
