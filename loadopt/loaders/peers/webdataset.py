"""The `webdataset` peer backend: WebDataset's tar shards and its own loop.

Conversion: the JPEG bytes, label and index of each sample in index order, in tar shards of about
`shard_mib` MiB written with WebDataset's `TarWriter`. Each epoch is WebDataset's idiomatic pipeline
(`wds.DataPipeline` in a `wds.WebLoader` of `num_workers` processes): the shard list shuffled, shards
split over the workers, each worker's samples shuffled in a `shuffle_buffer` buffer (both seeded by
(seed, epoch)), the config's pipeline mapped over them (`peer_base.CropSample`), batched in the worker.
Its tar streams are opened through the storage tier when there is one (`reads_through_tier`), so
an emulated tier's limits apply to every byte and a remote home is read from its storage.

A dataset that is tar shards already (`dataset.format: webdataset`) is read as it is, with no conversion:
WebDataset's natural path. Its shards are opened through the dataset's filesystem; each sample WebDataset
groups is found in loadopt's index by (shard, key), for its index (the crop plan) and label, so it gets
the same crop and label as on every other backend; a sample the index left out is passed over.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import fsspec
import numpy as np
from pydantic import Field
from typing_extensions import TypedDict

from loadopt.errors import DatasetError
from loadopt.loaders.peers.base import (
    DONE,
    ConversionMeta,
    ConversionSettings,
    CropSample,
    PeerLoader,
    PeerSettings,
    Skipped,
    epoch_seed,
    source_samples,
)
from loadopt.loaders.peers.batches import CroppedSample, PeerBatch, collate
from loadopt.storage.forms import placement
from loadopt.storage.sources.tar_members import IMAGE_MEMBER_EXTENSIONS
from loadopt.storage.sources.webdataset import WebDataset


class WebDatasetSettings(PeerSettings):
    shard_mib: float = Field(32, gt=0)  # tar shard size of the conversion


class ShardUrl(TypedDict):
    """A shard as WebDataset's shard list hands it on."""

    url: str


class OpenShard(ShardUrl):
    """A shard opened for WebDataset's tar expander."""

    stream: IO[bytes]


class _Opener:
    """Opens each shard URL: through the tier's filesystem when there is one, else as a local file."""

    def __init__(self, fs: fsspec.AbstractFileSystem | None) -> None:
        self.fs = fs

    def __call__(self, urls: Iterator[ShardUrl]) -> Iterator[OpenShard]:
        for item in urls:
            url = item["url"]
            # closed by WebDataset's tar expander when the shard is read
            yield {**item, "stream": self.fs.open(url, "rb") if self.fs is not None else open(url, "rb")}  # noqa: SIM115


class SourceSamples:
    """The samples WebDataset groups from a tar-shard dataset's own shards, matched to loadopt's index by
    (shard, key): `known` passes over those the index left out, `crop` runs the pipeline with the index's
    sample number and label."""

    def __init__(self, shards: list[str], shard_of: np.ndarray, keys: np.ndarray, labels: np.ndarray,
                 crop: CropSample) -> None:
        self.index_of = {(shards[int(s)], k.decode()): i for i, (s, k) in enumerate(zip(shard_of, keys, strict=True))}
        self.labels, self.crop = labels, crop

    def known(self, sample: dict) -> bool:
        return (sample["__url__"], sample["__key__"]) in self.index_of

    def __call__(self, sample: dict) -> CroppedSample:
        index = self.index_of[(sample["__url__"], sample["__key__"])]
        data = next(sample[e] for e in IMAGE_MEMBER_EXTENSIONS if e in sample)
        return self.crop(data, index, int(self.labels[index]))


class WebDatasetLoader(PeerLoader[WebDatasetSettings]):
    name = "webdataset"
    module = "webdataset"
    dist = "webdataset"
    reads_through_tier = True
    Settings = WebDatasetSettings

    def conversion_settings(self) -> ConversionSettings:
        return {"shard_mib": self.settings.shard_mib}

    def describe(self) -> str:
        own = self.source_shards() is not None
        shards = "the dataset's own tar shards" if own else f"tar shards {self.settings.shard_mib:g} MiB"
        return f"{shards} {super().describe()}"

    def source_shards(self) -> WebDataset | None:
        """The dataset, where it is tar shards already: read as they are (no conversion)."""
        return self.dataset if isinstance(self.dataset, WebDataset) else None

    def prepare(self, progress=None, convert_missing: bool = True) -> None:
        source = self.source_shards()
        if source is None:
            super().prepare(progress, convert_missing)
            return
        self.path = Path(source.root)
        self.meta = ConversionMeta(shards=[s.decode() for s in source.shards], samples=len(source))
        self.unreadable = self.skipped_at_open()

    def reads_conversion(self) -> bool:
        return self.source_shards() is None

    def storage_files(self) -> list[str]:
        source = self.source_shards()
        return source.local_files() if source is not None else super().storage_files()

    def _write(self, folder: Path, skipped: Skipped) -> ConversionMeta:
        import webdataset as wds

        total = int(self.dataset.sizes.sum())
        # at least 8 shards, so that up to 8 workers each get one (WebDataset splits shards over workers)
        limit = min(self.settings.shard_mib * 2**20, math.ceil(total / 8))
        digits = max(4, len(str(math.ceil(total / limit))))
        shards: list[str] = []
        writer, written = None, 0
        try:
            for index, label, data in source_samples(self.dataset, self.on_error, skipped):
                if writer is None or written >= limit:
                    if writer is not None:
                        writer.close()
                    shards.append(f"shard-{len(shards):0{digits}d}.tar")
                    writer, written = wds.TarWriter(str(folder / shards[-1])), 0
                writer.write({"__key__": f"{index:09d}", "jpg": data, "cls": str(label).encode(),
                              "idx": str(index).encode()})
                written += len(data)
        finally:
            if writer is not None:
                writer.close()
        return ConversionMeta(shards=shards, samples=len(self.dataset) - len(skipped))

    def shard_urls(self) -> list[str]:
        """The shards as the tier names them (the local files, or their copies on a remote home); a tar-shard
        dataset's own, as its filesystem names them."""
        source = self.source_shards()
        if source is not None:
            return [s.decode() for s in source.shards]
        path, meta = self.conversion()
        if meta.shards is None:
            raise DatasetError(f"{path}: its {DONE} lists no shards (not a webdataset conversion?)")
        remote = placement.publish(self.dataset, path, marker=DONE)
        base = remote if remote is not None else str(path)
        return [f"{base}/{name}" for name in meta.shards]  # read through `conversion_tier` (after the upload)

    def pipeline_for(self, epoch: int):
        """WebDataset's pipeline for one epoch, as a WebDataset user writes it."""
        import webdataset as wds
        from webdataset.tariterators import group_by_keys, tar_file_expander

        seed = epoch_seed(self.seed, epoch)
        shards = self.shard_urls()
        dataset = self.source_shards()
        if dataset is not None:
            samples = SourceSamples(shards, dataset.shard_of, dataset.keys, dataset.labels, self.crop_sample(epoch))
            opener = _Opener(None if dataset.is_local() else dataset.fs)
            stages = [wds.select(samples.known), wds.map(samples)]
        else:
            opener = _Opener(placement.conversion_tier(self.dataset))
            stages = [wds.map(self.crop_sample(epoch).on_record)]
        return wds.DataPipeline(
            wds.SimpleShardList(shards, seed=seed),
            wds.split_by_worker,
            opener,
            tar_file_expander,
            group_by_keys,
            wds.shuffle(self.settings.shuffle_buffer, initial=min(100, self.settings.shuffle_buffer), seed=seed),
            *stages,
            wds.batched(self.pipeline.batch_size, collation_fn=collate, partial=True),
        )

    def library_loader(self, epoch: int) -> Iterable[PeerBatch]:
        import webdataset as wds

        return wds.WebLoader(self.pipeline_for(epoch), batch_size=None, **self.dataloader_options())
