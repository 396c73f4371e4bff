"""What the peer backends share: other libraries' input paths (WebDataset, MosaicML Streaming, LitData,
FFCV) run as loadopt backends, so that the same harness measures them beside loadopt's own paths.

A peer converts the dataset to its library's format once (`convert_once`: keyed by the source's
fingerprint, written under a temporary name and renamed, in the cache or `storage.converted` like
loadopt's own conversions), then each epoch runs the library's own loader: its reader, its order
(shard and buffer shuffles seeded by (seed, epoch)), its worker processes. Where the library lets a
transform be supplied, the transform is the config's pipeline (`CropSample`: the shared crop plan of
`transforms.plan`, so the recipe is loadopt's JPEG paths' own); a peer with its own augmentation
(FFCV) names the difference in its recipe. Workers deliver uint8 NHWC crops; normalisation is the
shared finishing on the device, as for loadopt's tuned paths.

The order is the library's, not the shared one: the batches the base class plans are used for their
sizes only (`rebatch` cuts the library's stream to them: a library's workers each end on a partial
batch), and labels say `order=<library>`. Resuming mid-epoch replays the library's epoch (deterministic
for a given seed and epoch) and drops the samples already delivered, so nothing repeats or is skipped.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from loadopt.config_models import PipelineConfig
from loadopt.errors import ConfigError, DatasetError, describe_sample_error, shown_name
from loadopt.files import cache_dir
from loadopt.loaders import transforms
from loadopt.loaders.base import HostBatch, Layout, Loader, WorkKind
from loadopt.loaders.peers.batches import CroppedSample, PeerBatch, rebatch
from loadopt.machine import usable_cores
from loadopt.recipe import Recipe
from loadopt.storage.forms import placement

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DONE = "loadopt-peer.json"  # written last into a finished conversion: its metadata


def install_hint(extra: str) -> str:
    """How to install a peer's extra keeping this machine's torch and numpy (alone, pip may replace torch)."""
    return f"loadopt doctor --constraints > keep.txt; pip install 'loadopt[{extra}]' -c keep.txt"


class PeerSettings(BaseModel):
    """The knobs every peer built on a torch DataLoader has (a library's own knobs are added by its backend)."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(default_factory=lambda: min(8, usable_cores()), ge=0)
    prefetch_factor: int = Field(2, ge=1)
    decoder: Literal["auto", "pil", "simplejpeg"] = "auto"  # auto: the fastest installed (simplejpeg)
    shuffle_buffer: int = Field(1000, ge=1)  # samples a worker shuffles among (shard formats' approximate shuffle)


PeerSettingsT = TypeVar("PeerSettingsT", bound=PeerSettings)

# What a conversion depends on beyond the source (a shard size, a stored form): part of its folder's key.
ConversionSettings = dict[str, float | str | None]
# (index, reason) of each sample a conversion could not read (`on_error: skip`).
Skipped = list[tuple[int, str]]


class ConversionMeta(BaseModel):
    """A finished conversion's metadata, its `DONE` file (its keys in this order; `shards` only where the
    library's reader is handed its files)."""

    shards: list[str] | None = None  # webdataset: its tar shards, in order
    samples: int  # samples converted
    skipped: Skipped = Field(default_factory=list)

    def text(self) -> str:
        """The `DONE` file's text: the keys that have values, as the metadata's dict was always written."""
        return json.dumps(self.model_dump(exclude_none=True))


class DataLoaderOptions(TypedDict):
    """The torch DataLoader arguments a library's loader takes."""

    num_workers: int
    prefetch_factor: int | None  # None without workers, as DataLoader requires
    persistent_workers: bool


class StoredRecord(TypedDict):
    """What a peer's conversion stores per sample; read back, a library may give the ints as text or bytes."""

    jpg: bytes  # the source's stored (JPEG) bytes
    cls: int | str | bytes  # its label
    idx: int | str | bytes  # its dataset index


def library_available(module: str, dist: str, hint: str) -> tuple[bool, str]:
    """Whether `module` imports (any failure counts: a library may pull a broken dependency)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason shown
        text = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return False, f"{dist} is not usable ({text}); {hint}"
    return True, ""


def epoch_seed(seed: int, epoch: int) -> int:
    """One integer seed for a library's shuffles from (seed, epoch)."""
    return int(transforms.sample_hash(seed, epoch, np.zeros(1, np.int64))[0] % np.uint64(2**31 - 1))


# ---------------------------------------------------------------------------------------------
# The conversion


def conversion_path(dataset, library: str, settings: ConversionSettings) -> Path:
    """Where `dataset` converted to `library`'s format with `settings` lives (a folder)."""
    key_fields = {"version": FORMAT_VERSION, "source": dataset.fingerprint, "library": library, **settings}
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    return placement.local_dir(dataset, cache_dir()) / "peers" / f"{dataset.fingerprint}-{library}-{key}"


def read_meta(path: Path) -> ConversionMeta | None:
    """The metadata of a finished conversion at `path`, or None when there is none."""
    try:
        return ConversionMeta.model_validate_json((path / DONE).read_text())
    except FileNotFoundError:
        return None


def convert_once(path: Path, write: Callable[[Path, Skipped], ConversionMeta]) -> ConversionMeta:
    """The conversion at `path`, made by `write(folder, skipped)` into a temporary folder beside it and
    renamed into place when finished (an interrupted one is never used; one finished by another process
    meanwhile wins). `write` returns metadata; `skipped` collects (index, reason) of unreadable samples."""
    meta = read_meta(path)
    if meta is not None:
        return meta
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        temp.mkdir()
        skipped: Skipped = []
        written = write(temp, skipped)
        (temp / DONE).write_text(written.model_copy(update={"skipped": skipped}).text())
        try:
            os.rename(temp, path)
        except OSError:  # another process finished the same conversion first
            if read_meta(path) is None:
                raise
    except OSError as exc:
        raise DatasetError(f"{path}: cannot write the conversion ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    done = read_meta(path)
    if done is None:
        raise DatasetError(f"{path}: the finished conversion has no {DONE} (removed meanwhile?)")
    return done


def source_samples(dataset, on_error: str, skipped: Skipped) -> Iterator[tuple[int, int, bytes]]:
    """(index, label, stored bytes) of every sample in index order; unreadable ones raise, or are
    appended to `skipped` as (index, reason) under `on_error: skip`."""
    for index in range(len(dataset)):
        try:
            data = dataset.read(index)
        except OSError as exc:
            reason = f"cannot read ({type(exc).__name__}: {exc})".splitlines()[0]
            if on_error == "raise":
                raise DatasetError(f"{shown_name(dataset.path(index))}: {reason} (set dataset.on_error: skip to "
                                   "skip it)") from None
            skipped.append((index, reason))
            continue
        yield index, int(dataset.labels[index]), data


# ---------------------------------------------------------------------------------------------
# In the library's workers


class CropSample:
    """The config's pipeline on one stored sample, run in a library's worker: decode, the shared crop plan
    of (seed, epoch, index), resize, flip, as a `CroppedSample`: its pixels HWC as loadopt's own rings hold
    crops (`transforms.decode_batch`), the same work on both sides."""

    def __init__(self, pipeline: PipelineConfig, seed: int, epoch: int, decoder: str) -> None:
        self.augment, self.size = pipeline.augment, pipeline.image_size
        self.seed, self.epoch, self.decoder = seed, epoch, transforms.decoder_name(decoder)

    def __call__(self, data: bytes, index: int, label: int) -> CroppedSample:
        out = torch.empty((self.size, self.size, 3), dtype=torch.uint8)
        try:
            transforms.write_sample(data, out.permute(2, 0, 1), self.decoder, "torch", self.augment, self.seed,
                                    self.epoch, index)
        except Exception as exc:  # noqa: BLE001 - a bad sample is reported, by policy, in the consumer
            return CroppedSample(None, label, index, f"{describe_sample_error(exc)} (sample {index})")
        return CroppedSample(out, label, index, None)

    def on_record(self, record: StoredRecord) -> CroppedSample:
        """The pipeline on one stored record (`record`'s fields; ints may come back as text or bytes)."""
        return self(record["jpg"], int(record["idx"]), int(record["cls"]))


def record(index: int, label: int, data: bytes) -> StoredRecord:
    """What a peer's conversion stores per sample: the stored JPEG bytes, its label and dataset index."""
    return {"jpg": data, "cls": label, "idx": index}


_CROPPED: dict[str, type[Any]] = {}


def cropped(base: type[Any], name: str) -> type[Any]:
    """`base` (a library's dataset class whose items are `record`s) with `__getitem__` running the config's
    pipeline on each (`CropSample`, given first to `__init__`): how these libraries take a transform.
    Made on first use (the library is optional) and kept here under `name`, so workers can find it."""
    if name not in _CROPPED:

        def __init__(self, crop: CropSample, **kwargs: Any) -> None:
            base.__init__(self, **kwargs)
            self.crop = crop

        def __getitem__(self, key: Any) -> CroppedSample:
            return self.crop.on_record(base.__getitem__(self, key))

        cls = type(name, (base,), {"__init__": __init__, "__getitem__": __getitem__, "__module__": __name__})
        globals()[name] = _CROPPED[name] = cls
    return _CROPPED[name]


class PeerLoader(Loader[PeerSettingsT]):
    """A backend that runs another library's input path. Subclasses set `module`, `dist`, implement
    `_write` (the conversion into a folder) and `library_loader` (the library's loader for one epoch,
    yielding `PeerBatch`es: what a training script written for that library iterates)."""

    module: ClassVar[str]  # the library's import name
    dist: ClassVar[str]  # its pip name
    reads_through_tier: ClassVar[bool] = False  # whether its reader can be handed the tier's file objects
    shared_order = False
    Settings = PeerSettings

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        readable, why = self.supports(self.dataset)
        if not readable:
            raise ConfigError(f"loaders.{self.name}: {why} (a peer backend)")
        if self.world_size > 1:
            raise ConfigError(f"loaders.{self.name}: peer backends run one rank here (their own node splitting "
                              "differs from loadopt's shared order)")
        self.path: Path | None = None
        self.meta: ConversionMeta | None = None

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return library_available(cls.module, cls.dist, install_hint(cls.name))

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list]:
        return {"num_workers": [n for n in (1, 2, 4, 8, 16, 32) if n < cores] + [cores], "prefetch_factor": [2, 4]}

    @classmethod
    def cpu_demand(cls, settings: PeerSettingsT) -> int:
        return max(1, settings.num_workers)

    @classmethod
    def memory_demand(cls, settings: PeerSettingsT, pipeline: PipelineConfig) -> dict[str, int]:
        in_flight = max(1, settings.num_workers) * settings.prefetch_factor + 2
        return {"shared": in_flight * pipeline.batch_size * 3 * pipeline.image_size ** 2, "pinned": 0}

    def conversion_settings(self) -> ConversionSettings:
        """What the conversion depends on beyond the source (a shard size, a stored form)."""
        return {}

    @classmethod
    def work_kind(cls, settings, recipe=None) -> str:
        return WorkKind.JPEG_DECODE  # the libraries store the source JPEGs and decode them every epoch

    def reads_conversion(self) -> bool:
        return True

    def describe(self) -> str:
        s = self.settings
        return f"num_workers={s.num_workers} prefetch={s.prefetch_factor} order={self.name}" + \
            placement.via_tier(self.dataset, conversion=True)

    def recipe(self) -> Recipe:
        # the library's order, not the sampler's: `auto` passes it over unless pipeline.order is `any`
        return {**super().recipe(), "order": self.name}

    def _local_only(self) -> None:
        if self.reads_through_tier:
            return
        if placement.conversion_tier(self.dataset) is not None or placement.remote_home(self.dataset) is not None:
            raise ConfigError(f"loaders.{self.name}: {self.dist} reads its conversion from the local disk itself; "
                              "it cannot read through storage.tier (use storage.tier: local)")

    def prepare(self, progress=None, convert_missing: bool = True) -> None:
        self._local_only()
        path = conversion_path(self.dataset, self.name, self.conversion_settings())
        meta = read_meta(path)
        if meta is None:
            if not convert_missing:
                raise DatasetError(f"{path}: no {self.dist} conversion of {self.dataset.root}; run `loadopt bench` "
                                   f"with loaders.{self.name} to make it")
            log.info("converting %s to %s at %s", self.dataset.root, self.dist, path)
            meta = convert_once(path, self._write)
        self.path, self.meta = path, meta
        self.unreadable = {**self.skipped_at_open(), **dict(meta.skipped)}
        self._opened()

    def _opened(self) -> None:  # noqa: B027 - optional hook: a library that opens its files once
        """Open the finished conversion at `self.path` (after `prepare`)."""

    def _write(self, folder: Path, skipped: Skipped) -> ConversionMeta:
        raise NotImplementedError

    def conversion(self) -> tuple[Path, ConversionMeta]:
        """The finished conversion's folder and metadata (`prepare`d first when it is not yet)."""
        if self.path is None or self.meta is None:
            self.prepare(convert_missing=False)
        assert self.path is not None and self.meta is not None  # prepare sets both, or raises
        return self.path, self.meta

    def storage_files(self) -> list[str]:
        path, _ = self.conversion()
        if placement.remote_home(self.dataset) is not None:
            return []
        return sorted(str(p) for p in path.rglob("*") if p.is_file() and p.name != DONE)

    def crop_sample(self, epoch: int) -> CropSample:
        return CropSample(self.pipeline, self.seed, epoch, self.settings.decoder)

    def dataloader_options(self) -> DataLoaderOptions:
        """The torch DataLoader arguments a library's loader takes (workers, prefetch)."""
        workers = self.settings.num_workers
        return {"num_workers": workers, "prefetch_factor": self.settings.prefetch_factor if workers else None,
                "persistent_workers": False}

    def library_loader(self, epoch: int) -> Iterable[PeerBatch]:
        """The library's loader for epoch `epoch` (its batches in the library's order)."""
        raise NotImplementedError

    def library_batches(self, epoch: int) -> Generator[PeerBatch, None, None]:
        """The library's own loop over epoch `epoch`: what a training script written for it iterates."""
        if self.path is None:
            self.prepare()
        iterator = iter(self.library_loader(epoch))
        try:
            yield from iterator
        finally:
            shutdown(iterator)

    def bare_batches(self, epoch: int) -> Generator[tuple[torch.Tensor, torch.Tensor, Layout], None, None]:
        """The library's bare loop over epoch `epoch`, as a training script written for it iterates: each of
        its batches' (uint8 inputs, labels, layout) as the library hands them, nothing copied or cut (the
        reference `benchmarks/peers.py --truth` holds the harness to)."""
        stream = self.library_batches(epoch)
        try:
            for batch in stream:
                yield batch["inputs"], batch["labels"], batch.get("layout", "NCHW")
        finally:
            stream.close()

    def produce(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        if self.path is None:
            self.prepare()
        planned = self.order().batches()
        done = len(planned) - len(batches)  # a resumed epoch: batches already delivered
        known = np.fromiter(self.unreadable, np.int64)  # never in the conversion
        skip = sum(int((~np.isin(b, known)).sum()) for b in planned[:done])
        stream = self.library_batches(self.epoch)
        try:
            yield from rebatch(stream, [len(b) for b in batches], skip)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()


def shutdown(iterator: Any) -> None:
    """Stop a torch DataLoader iterator's worker processes now (not whenever it is collected)."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()
