"""The `streaming` peer backend: MosaicML Streaming's MDS shards and its own loop.

Conversion: the JPEG bytes, label and index of each sample in index order, in MDS shards of about
`shard_mib` MiB written with Streaming's `MDSWriter` (uncompressed: JPEGs do not compress). Each
epoch is Streaming's idiomatic loop: a `StreamingDataset` over the local shards, subclassed to run
the config's pipeline in `__getitem__` (`peer_base.CropSample`, as Streaming's own vision datasets
run their transforms there), shuffled by Streaming's algorithm with `shuffle_seed` from (seed,
epoch), batched by a `StreamingDataLoader` of `num_workers` processes. Streaming reads its shards from
the local disk itself (its `remote` downloads whole shards into `local` first), so it runs on the local
tier only.
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


class StreamingSettings(PeerSettings):
    shard_mib: float = Field(32, gt=0)  # MDS shard size of the conversion


class StreamingLoader(PeerLoader[StreamingSettings]):
    name = "streaming"
    module = "streaming"
    dist = "mosaicml-streaming"
    Settings = StreamingSettings

    def conversion_settings(self) -> ConversionSettings:
        return {"shard_mib": self.settings.shard_mib}

    def describe(self) -> str:
        return f"MDS shards {self.settings.shard_mib:g} MiB " + super().describe()

    def _write(self, folder: Path, skipped: Skipped) -> ConversionMeta:
        from streaming import MDSWriter

        columns = {"jpg": "bytes", "cls": "int", "idx": "int"}
        with MDSWriter(out=str(folder), columns=columns, size_limit=int(self.settings.shard_mib * 2**20)) as writer:
            for sample in source_samples(self.dataset, self.on_error, skipped):
                writer.write(record(*sample))
        return ConversionMeta(samples=len(self.dataset) - len(skipped))

    def library_loader(self, epoch: int) -> Iterable[PeerBatch]:
        """Streaming's dataset for one epoch (its shuffle seeded by (seed, epoch)) in its DataLoader."""
        from streaming import StreamingDataLoader, StreamingDataset

        dataset = cropped(StreamingDataset, "CroppedStreamingDataset")(
            self.crop_sample(epoch), local=str(self.path), shuffle=True, shuffle_seed=epoch_seed(self.seed, epoch),
            batch_size=self.pipeline.batch_size)
        return StreamingDataLoader(dataset, batch_size=self.pipeline.batch_size, collate_fn=collate,
                                   drop_last=self.pipeline.drop_last, **self.dataloader_options())
