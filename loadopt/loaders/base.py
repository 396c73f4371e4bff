"""The Loader contract every backend implements (docs/plugins.md): `Loader`, the `HostBatch` it produces,
the `WorkKind` that bounds it, and its counters. The registry of backends by name is `loadopt.loaders.registry`.

A backend subclasses `Loader[MySettings]`, declares its knobs as a pydantic `Settings` model and implements
`produce(batches)`: turn the given batches of sample indices into `HostBatch`es, in order. The base
class owns everything that must be the same for every backend: the shared sample order, epochs,
mid-epoch resumption, the `on_error` policy, the counters, and finishing a batch on the device
(copy, NHWC->NCHW, normalisation). A backend also declares what bounds it (`work_kind`, one of
`WorkKind`: the ceiling the attribution holds it to) and what it can read (`supports`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Generic, Literal, TypedDict, TypeVar, cast

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from loadopt.config_models import PipelineConfig
from loadopt.device import DeviceTransfer, HostCopyDone, finish_inputs
from loadopt.errors import DatasetError, shown_name
from loadopt.loaders.fields import Batch, collate_fields, fields_to_carry
from loadopt.loaders.heap import TRIM_EVERY, release_free_heap
from loadopt.loaders.recycled_memory import RecycledBuffers
from loadopt.loaders.sample_transform import SampleTargets, SampleTransform
from loadopt.loaders.sampler import EpochOrder, LoaderSampler, ShardWindows
from loadopt.loaders.serving import RequestPath, Unservable
from loadopt.recipe import Recipe
from loadopt.storage.dataset import Dataset, SampleFields
from loadopt.storage.sources.shards import shard_table

log = logging.getLogger(__name__)

# The memory layout of a produced batch's inputs: NCHW or NHWC pixels, or (B, seq_len) token ids.
Layout = Literal["NCHW", "NHWC", "tokens", "records"]

# fn(inputs, labels) -> (inputs, labels) on each finished batch (see `Loader`)
BatchTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class WorkKind(str, Enum):
    """What bounds a loader setting: the work per sample whose measured capacity the attribution
    holds the setting to."""

    JPEG_DECODE = "jpeg_decode"  # decode each source JPEG every epoch, crop, resize (the decode ceiling)
    # decode the encoded forms' stored JPEGs (restart markers: only the intervals around each crop), crop,
    # resize: the same pixels as JPEG_DECODE for less work (the stored-JPEG decode ceiling)
    STORED_JPEG_DECODE = "stored_jpeg_decode"
    CROP_RESIZE = "crop_resize"  # crop + resize stored decoded whole frames (the crop + resize ceiling)
    PIXEL_COPY = "pixel_copy"  # copy crops of stored decoded pixels (the memory-copy ceiling)
    TOKEN_GATHER = "token_gather"  # gather token windows (the memory-copy ceiling)
    DEVICE_DECODE = "device_decode"  # decode on the accelerator (no device-decode ceiling is measured yet:
    #                                  held to the host decode ceiling, and to the host-to-device link)
    IO = "io"  # read the stored bytes and little else (the storage read ceiling)


def work_kind_of_recipe(recipe: Recipe | None) -> WorkKind:
    """The work a recipe (`loadopt.recipe`) implies: token windows, records read, stored whole frames cropped
    and resized, stored centre squares copied, or the source JPEG decoded every epoch."""
    if not recipe:  # none recorded: the source JPEG decoded every epoch
        return WorkKind.JPEG_DECODE
    if recipe.get("kind") == "tokens":
        return WorkKind.TOKEN_GATHER
    if recipe.get("kind") == "records":  # read the record, hand its first bytes over: the storage read bounds it
        return WorkKind.IO
    stored = str(recipe.get("stored", "source"))
    if stored.startswith("whole frame"):
        return WorkKind.CROP_RESIZE
    if stored.startswith("centre"):
        return WorkKind.PIXEL_COPY
    return WorkKind.JPEG_DECODE


class LoaderState(TypedDict):
    """Where a loader is in its epochs (`Loader.state_dict`), as a training checkpoint stores it: a plain dict."""

    backend: str
    epoch: int
    batches_done: int  # of this epoch: the next batch delivered after a resume is the one after them
    seed: int
    rank: int
    world_size: int
    num_samples: int
    batch_size: int


# The keys of a state that must be this loader's for it to resume there (the same order of the same samples).
RESUMED_ONLY_IF_EQUAL: tuple[Literal["seed", "rank", "world_size", "num_samples", "batch_size"], ...] = (
    "seed", "rank", "world_size", "num_samples", "batch_size")


class NoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A backend's settings model: `Loader[TorchSettings]` types `self.settings` and the classmethods' settings.
SettingsT = TypeVar("SettingsT", bound=BaseModel)


@dataclass
class HostBatch:
    """One batch as a backend produced it, before it is finished on the device."""

    inputs: torch.Tensor  # NCHW float (normalised) or uint8 in `layout`; token ids (B, seq_len) for tokens
    labels: torch.Tensor  # class ids; the shifted token ids for tokens
    indices: np.ndarray  # the dataset indices actually in the batch, in order
    layout: Layout = "NCHW"
    normalised: bool = True
    # (index, reason) of samples that could not be read or decoded; not in `inputs`.
    failures: list[tuple[int, str]] = field(default_factory=list)
    bytes_read: int | None = None  # bytes the backend read from storage; None: the samples' file sizes
    # True when `inputs` is a view of a buffer the backend reuses (a ring slot): finishing copies it
    # out whenever the finished batch would otherwise still share that memory.
    borrowed: bool = False
    # Set for a borrowed batch copied asynchronously (by `finish` on CUDA, by the harness on its emulated
    # device): the copy's end event, which the backend waits on before it lets the buffer be reused.
    copy_done: torch.cuda.Event | HostCopyDone | None = None
    # The carried fields' values as the job's transform of (image, target) made them (else read by index).
    fields: dict[str, list] | None = None


@dataclass
class LoaderCounters:
    """What a loader did, as counted by the loader itself (in the consumer process)."""

    batches: int = 0
    samples: int = 0
    bytes_delivered: int = 0  # stored (encoded) size of the delivered samples
    bytes_read: int = 0  # bytes read from storage, re-reads and amplification included
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) under on_error=skip


class Loader(ABC, Generic[SettingsT]):
    """A data-loading backend, generic over its `Settings` model. Iterating yields `(inputs, labels)` on `device`.

    As a DataLoader, each `for` over the loader is a pass over the current epoch from its first batch
    (a `break` leaves nothing half-done behind), and a pass that runs to the end moves to the next epoch;
    the first `for` after `load_state_dict` resumes where the state was taken instead.
    `batch_transform(inputs, labels) -> (inputs, labels)`, when set, runs on each finished batch on the
    device (mixup, cutmix: what a DataLoader's `collate_fn` did on the host)."""

    name: ClassVar[str] = "base"
    # The model of `SettingsT` (a class variable cannot name the type variable: each subclass sets its own).
    Settings: ClassVar[type[BaseModel]] = NoSettings
    settings: SettingsT
    # False: another library orders the samples (the peer backends; their labels say `order=<library>`)
    shared_order: ClassVar[bool] = True
    # True: the backend's native code can crash the process on bad bytes (DALI's decoder): `loadopt bench` runs it
    # in a child process where it can, and elsewhere lets it see only samples `screen_samples` checked first.
    runs_apart: ClassVar[bool] = False
    # True: the backend runs the job's own per-sample transform (`pipeline.transform`) where it makes its samples.
    runs_sample_transform: ClassVar[bool] = False

    def __init__(self, dataset: Dataset, pipeline: PipelineConfig,
                 settings: SettingsT | None = None, *,
                 device: str | torch.device = "cpu", rank: int = 0, world_size: int = 1, seed: int = 0,
                 epoch: int = 0, on_error: Literal["raise", "skip"] = "raise") -> None:
        if len(dataset) == 0:
            raise DatasetError(f"{dataset.root}: the dataset has no samples")
        self.dataset = dataset
        self.pipeline = pipeline
        # `Settings` is the model of `SettingsT` (one per subclass), so its default instance is one.
        self.settings = settings if settings is not None else cast(SettingsT, self.Settings())
        self.device = torch.device(device)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.on_error = on_error
        self.counters = LoaderCounters()
        # Samples that the conversion this backend reads could not decode (on_error: skip), index -> reason:
        # never produced, reported as failures of their batches (set by `prepare`).
        self.unreadable: dict[int, str] = {}
        self._epoch, self._position = epoch, 0
        self._resume = False  # the next `for` continues at `_position` (set by `load_state_dict`)
        self.batch_transform: BatchTransform | None = None
        self._sample_transform: SampleTransform | None = None  # imported when first asked for
        # The fields besides image and label each batch carries (`pipeline.fields`, else the dataset's own).
        self.field_names = fields_to_carry(dataset, pipeline)
        self.unreadable.update(self.skipped_at_open())
        if self.unreadable and on_error == "raise":
            index, why = next(iter(self.unreadable.items()))
            raise DatasetError(f"{shown_name(dataset.path(index))}: {why} (set dataset.on_error: skip to skip it)")
        self._transfer = DeviceTransfer(self.device, emulate=False)
        self._intermediates: dict[tuple, torch.Tensor] = {}
        self._handed_out = RecycledBuffers()  # the finished batches' memory on a CPU device
        self._windows: ShardWindows | None = None
        self.order()  # validates rank/world_size/batch_size now rather than at first iteration

    # -- what a backend provides -----------------------------------------------------------------

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Whether this backend can run here, and why not. Never raises."""
        return True, ""

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list[Any]]:
        """The values the tuner may try for each knob of `Settings`, on a machine of `cores` cores.

        Each list is ordered from the least to the most resources; knobs not listed stay at their
        configured value. The tuner never hard-codes a backend's knobs: this is where they live."""
        return {}

    @classmethod
    def cpu_demand(cls, settings: SettingsT) -> int:
        """The most cores a setting can keep busy at once (worker processes x threads per process),
        so that the tuner never proposes more than the machine has."""
        return 1

    @classmethod
    def memory_demand(cls, settings: SettingsT, pipeline: PipelineConfig) -> dict[str, int]:
        """Bytes of shared (`shared`) and page-locked (`pinned`) memory a setting holds, so that the tuner
        never proposes more than is free."""
        return {"shared": 0, "pinned": 0}

    @classmethod
    def work_kind(cls, settings: SettingsT, recipe: Recipe | None = None) -> str:
        """What bounds `settings` (a `WorkKind` value): the attribution holds the setting's runs to the
        ceiling of this work. `recipe` is what the setting's `recipe()` returned (None: not recorded).
        By default the recipe says it: the source JPEG decoded every epoch unless it stores something else."""
        return work_kind_of_recipe(recipe).value

    @classmethod
    def supports(cls, dataset: Dataset) -> tuple[bool, str]:
        """Whether this backend can read `dataset` (an image folder, a token corpus), and why not. Never
        raises. `make_loader(backend="auto")` and `loadopt bench` pass over a backend that cannot."""
        if dataset.kind != "images":
            return False, f"{cls.name} reads image datasets only"
        return True, ""

    @classmethod
    def runs_pipeline(cls, pipeline: PipelineConfig, settings: SettingsT) -> tuple[bool, str]:
        """Whether `settings` can deliver `pipeline` (its own per-sample transform, `augment: none`), and why not.
        Never raises. `make_loader` and `loadopt bench` pass over a setting that cannot."""
        if pipeline.transform is not None and not cls.runs_sample_transform:
            return False, (f"{cls.name} does not run a per-sample Python transform (pipeline.transform); "
                           "torch, arrow, posix and dali do")
        return True, ""

    @abstractmethod
    def produce(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        """Yield one `HostBatch` per entry of `batches`, in order: the extension point of every backend.

        `batches` are the shared order's batches of dataset indices (samples known to be unreadable already
        dropped); the base class counts, resumes and finishes what is yielded (docs/plugins.md)."""

    def screen_samples(self, progress: Callable[[int, int], None] | None = None) -> None:  # noqa: B027
        """Check every sample before the backend may see it, where `runs_apart` says bad bytes can crash its native
        code; a sample refused is then a failure under `on_error`. Nothing to do for the others."""

    def prepare(self, progress: Callable[[int, int], None] | None = None,  # noqa: B027 - optional hook
                convert_missing: bool = True) -> None:
        """Make ready what this backend reads (e.g. convert the dataset to its format), before any
        timing starts; `convert_missing=False` makes a missing conversion an error instead."""

    def skipped_at_open(self) -> dict[int, str]:
        """The samples without one of the fields the batches carry (`SampleFields.missing_fields`), index -> why:
        never produced, failures of their batches (skipped and counted under `on_error: skip`)."""
        if not self.field_names or not isinstance(self.dataset, SampleFields):
            return {}
        return self.dataset.missing_fields(self.field_names)

    def storage_files(self) -> list[str]:
        """The local files this loader reads (evicted from the page cache for cold runs); after `prepare`."""
        return self.dataset.local_files()

    def reads_conversion(self) -> bool:
        """Whether this setting reads the dataset's conversion (an Arrow file, raw shards, another library's
        format) rather than its source files: those may be on the local disk while the source is not."""
        return False

    def bytes_source(self) -> str:
        """Where this setting's bytes come from (results.json `runs[i].bytes_source`, the `bytes from`
        column); known before `prepare` but for a conversion whose upload `prepare` finds refused."""
        from loadopt.storage.forms.placement import bytes_source

        return bytes_source(self.dataset, conversion=self.reads_conversion())

    def recipe(self) -> Recipe:
        """The training input this setting delivers (`loadopt.recipe`): by default the crop plan on the
        source images, decoded every epoch; backends reading a decoded form say what they store."""
        from loadopt import recipe

        return recipe.delivered(self.pipeline, kind=self.dataset.kind)

    def request_paths(self, max_batch: int) -> list[RequestPath]:
        """This setting's ways of serving requests (the inference scenarios), each on its
        own row; `Unservable` with the reason for a backend that reads whole batches in an order it keeps."""
        raise Unservable(f"{self.name} reads batches of the dataset in an epoch's order; it has no request path")

    def describe(self) -> str:
        """A short label of this setting for tables (e.g. `plain num_workers=2`)."""
        return " ".join(f"{k}={v}" for k, v in self.settings.model_dump().items())

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release workers, threads and buffers."""

    # -- the shared protocol ---------------------------------------------------------------------

    @property
    def sample_transform(self) -> SampleTransform | None:
        """The job's per-sample transform, imported from `pipeline.transform` when first asked for
        (`make_loader(transform=fn)` sets the function itself before the first epoch)."""
        if self._sample_transform is None and self.pipeline.transform is not None:
            self.sample_transform = SampleTransform.of_pipeline(self.pipeline)
        return self._sample_transform

    @sample_transform.setter
    def sample_transform(self, transform: SampleTransform | None) -> None:
        if transform is not None and transform.with_target:
            transform.targets = SampleTargets(self.dataset, self.field_names)
        self._sample_transform = transform

    def order(self) -> EpochOrder:
        windows = None
        if self.pipeline.shuffle == "window":
            if self._windows is None:  # the dataset's shards, once: the same for every epoch
                self._windows = ShardWindows(shard_table(self.dataset, self.pipeline.shard_samples),
                                             self.pipeline.window_shards)
            windows = self._windows
        return EpochOrder(len(self.dataset), self.pipeline.batch_size, self.seed, self._epoch, self.rank,
                          self.world_size, self.pipeline.shuffle, self.pipeline.drop_last, windows)

    def __len__(self) -> int:
        return len(self.order())

    @property
    def batch_size(self) -> int:
        return self.pipeline.batch_size

    @property
    def drop_last(self) -> bool:
        return self.pipeline.drop_last

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def sampler(self) -> LoaderSampler:
        """The order as a DataLoader's `sampler`: where Lightning and Accelerate call `set_epoch` each epoch."""
        return LoaderSampler(self)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its first batch (a no-op for the epoch already under way)."""
        if epoch != self._epoch:
            self._epoch, self._position = epoch, 0

    def state_dict(self) -> LoaderState:
        return {"backend": self.name, "epoch": self._epoch, "batches_done": self._position, "seed": self.seed,
                "rank": self.rank, "world_size": self.world_size, "num_samples": len(self.dataset),
                "batch_size": self.pipeline.batch_size}

    def load_state_dict(self, state: LoaderState) -> None:
        """Resume where `state` was taken: the next batch is the first one not yet delivered."""
        for key in RESUMED_ONLY_IF_EQUAL:
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(f"loader state was taken with {key}={state[key]}, this loader has {key}={mine}")
        self._epoch, self._position = int(state["epoch"]), int(state["batches_done"])
        self._resume = True

    def host_batches(self) -> Generator[HostBatch, None, None]:
        """Batches as produced (host tensors, or device tensors for device backends), position kept."""
        order = self.order()
        batches: Sequence[np.ndarray] = order.batches(self._position)
        if getattr(self.dataset, "fs", None) is not None:  # the bounded local cache of remote shards, if any,
            from loadopt.storage.remote.shard_cache import fetch_ahead  # fetches this epoch's files ahead

            fetch_ahead(self.dataset, batches, self.pipeline.shard_samples)
        unreadable = self.unreadable
        if unreadable:
            known = np.fromiter(unreadable, np.int64)
            dropped = [b[np.isin(b, known)] for b in batches]
            batches = [b[~np.isin(b, known)] for b in batches]
        for n, batch in enumerate(self.produce(batches)):
            if (n + 1) % TRIM_EVERY == 0:
                release_free_heap()
            if unreadable and len(dropped[n]):
                batch.failures = [*batch.failures, *((int(i), unreadable[int(i)]) for i in dropped[n])]
            self._account(batch)
            self._with_made_targets(batch)
            self._position += 1
            yield batch
        if self._position >= len(order):
            self._epoch, self._position = self._epoch + 1, 0

    def finish(self, batch: HostBatch, transfer: DeviceTransfer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Move a host batch to the device and finish it there (layout, normalisation)."""
        transfer = transfer or self._transfer
        with transfer.device_work():
            inputs, labels = transfer.to_device(batch.inputs, batch.labels)
            if isinstance(batch.copy_done, HostCopyDone):
                batch.copy_done.set()  # the emulated device's copy has read the borrowed buffer
            # The emulated device owns reusable buffers; a real one (or a CPU training loop) gets fresh memory
            # for what it is handed, and this loader's one buffer for the transposed pixels on the way.
            scratch = transfer.scratch if transfer.emulate else self._intermediate
            out = finish_inputs(inputs, batch.layout, batch.normalised, self.pipeline, scratch)
        if batch.borrowed:
            if out.untyped_storage().data_ptr() == batch.inputs.untyped_storage().data_ptr():
                out = self._intermediate(tuple(out.shape), out.dtype).copy_(out) if out.device.type == "cpu" \
                    else out.clone()
            elif transfer.last.elapsed.events is not None:
                batch.copy_done = transfer.last.elapsed.events[1]
        return out, labels

    def _intermediate(self, shape: tuple[int, ...], dtype: torch.dtype, purpose: str = "out") -> torch.Tensor:
        """Scratch for `finish_inputs` outside the emulated device: the transposed uint8 pixels ("nhwc"), which
        never leave the finishing, in one buffer kept per shape; memory of the job's own for anything handed out
        (on the CPU recycled once the job drops it: fresh pages cost more than the finishing).
        A fresh 9.6 MB transpose every batch (64 x 224 px) made glibc raise its mmap threshold and serve
        them from a heap that fragmented: the consumer's memory, and that of the workers forked from it
        each epoch, grew 2-3x over the first epochs of benchmarks/soak.py (not a leak: freed, not returned)."""
        if purpose != "nhwc":
            if self.device.type == "cpu":
                return self._handed_out.empty(shape, dtype)
            return torch.empty(shape, dtype=dtype, device=self.device)
        key = (shape, dtype)
        if key not in self._intermediates:
            self._intermediates[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return self._intermediates[key]

    def __iter__(self) -> Iterator[Batch]:
        # A plain method, so the pass is placed when `iter()` is called, as a DataLoader's is.
        if self._position >= len(self.order()):  # a pass ended at its last batch (broken off there)
            self._epoch, self._position = self._epoch + 1, 0
        elif not self._resume:
            self._position = 0
        self._resume = False
        return self._finished_batches()

    def _with_made_targets(self, batch: HostBatch) -> None:
        """A transform of (image, target): the batch's labels and fields are what it made for its samples."""
        transform = self._sample_transform
        if transform is None or not transform.with_target or len(batch.indices) == 0:
            return
        labels, batch.fields = transform.take(batch.indices, self._epoch)
        batch.labels = torch.as_tensor(labels, dtype=batch.labels.dtype)

    def _finished_batches(self) -> Iterator[Batch]:
        for batch in self.host_batches():
            if len(batch.indices) == 0:  # every sample skipped (on_error: skip, counted): no batch to hand on
                continue
            inputs, labels = self.finish(batch)
            if self.batch_transform is not None:
                inputs, labels = self.batch_transform(inputs, labels)
            if self.field_names:
                assert isinstance(self.dataset, SampleFields), "fields_to_carry found them on the dataset"
                fields = batch.fields if batch.fields is not None else \
                    self.dataset.fields(batch.indices, self.field_names)
                yield inputs, labels, collate_fields(fields)
            else:
                yield inputs, labels

    def _account(self, batch: HostBatch) -> None:
        sizes = self.dataset.sizes
        failed = np.asarray([i for i, _ in batch.failures], dtype=np.int64)
        if batch.failures:
            if self.on_error == "raise":
                index, reason = batch.failures[0]
                raise DatasetError(f"{shown_name(self.dataset.path(index))}: {reason} (set dataset.on_error: skip to "
                                   "skip it)")
            for index, reason in batch.failures:
                log.warning("skipped %s: %s", shown_name(self.dataset.path(index)), reason)
                self.counters.skipped.append((self.dataset.path(index), reason))
        self.counters.batches += 1
        self.counters.samples += len(batch.indices)
        self.counters.bytes_delivered += int(sizes[batch.indices].sum())
        read = batch.bytes_read
        if read is None:
            read = int(sizes[batch.indices].sum()) + int(sizes[failed].sum())
        self.counters.bytes_read += read
