"""The `torch` backend: `torch.utils.data.DataLoader` over the ImageFolder, in two variants.

- `plain`: what most training scripts do: PIL decode, crop/resize/flip, float normalisation per
  sample in the workers, `default_collate` stacking float32 batches (4 bytes a channel through IPC).
- `tuned`: what an expert does: the fastest installed JPEG decoder, torch's uint8 resize kernel on a
  view of the decoded array, and batch assembly in the worker: `__getitems__` decodes straight into
  a slot of a ring of uint8 NHWC batches in shared memory allocated once (pinned with
  cudaHostRegister on CUDA), so no batch is allocated, page-faulted, pickled or copied on its way
  to the consumer; only indices and labels travel through the queue. Normalisation on the device.

Ring slots are reused safely: at most `num_workers * prefetch_factor` batches are in flight beyond
the last one yielded, the consumer holds one, and the ring has two more slots than that.

Workers receive `(epoch, index)` pairs, so per-sample augmentation follows the shared seed even with
persistent workers, which never see the consumer's state after they start.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.utils.data import DataLoader, default_collate
from typing_extensions import TypedDict

from loadopt.config_models import PipelineConfig
from loadopt.errors import DatasetError, WorkerDied
from loadopt.imaging.decode import simplejpeg
from loadopt.loaders import transforms
from loadopt.loaders.base import HostBatch, Loader
from loadopt.loaders.sample_transform import Made
from loadopt.loaders.serving import RequestPath, Unservable
from loadopt.loaders.torch_dl import workers as torch_workers
from loadopt.loaders.torch_dl.samples import Item, RecordSamples, TokenWindows, WorkerBatch, collate_windows, collated
from loadopt.machine import usable_cores
from loadopt.storage.sources.records import RecordDataset
from loadopt.storage.sources.tokens import TokenDataset


class TorchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    variant: Literal["plain", "tuned"] = "tuned"
    # One worker process per usable core, up to 8 (more only share the cores; the tuner tries them).
    num_workers: int = Field(default_factory=lambda: min(8, usable_cores()), ge=0)
    prefetch_factor: int = Field(2, ge=1)
    pin_memory: bool = True  # only takes effect with a CUDA device
    persistent_workers: bool = False
    # auto: PIL for `plain` (what most scripts use), the fastest installed decoder for `tuned`.
    decoder: Literal["auto", "pil", "simplejpeg"] = "auto"
    # auto: PIL's kernel for `plain`, torch's uint8 kernel for `tuned`.
    resize: Literal["auto", "pil", "torch"] = "auto"

    def resolved_decoder(self) -> str:
        if self.decoder == "auto":
            return "pil" if self.variant == "plain" else transforms.decoder_name("auto")
        if self.decoder == "simplejpeg" and simplejpeg is None:
            raise ValueError("decoder simplejpeg is not installed (pip install simplejpeg)")
        return self.decoder

    def resolved_resize(self) -> str:
        if self.resize == "auto":
            return "pil" if self.variant == "plain" else "torch"
        return self.resize


def _describe_error(exc: BaseException) -> str:
    from loadopt.errors import describe_sample_error

    text = str(exc)
    if isinstance(exc, OSError) and not text.startswith("cannot identify") and "truncated" not in text.lower():
        return f"cannot read ({type(exc).__name__}: {exc})"  # the storage's error, not the image's
    return describe_sample_error(exc)


# One image sample of the plain path: (pixels, label, dataset index, why it failed); pixels None when it did.
PlainSample = tuple[torch.Tensor | None, int, int, str | None]
# A plain batch's samples as a worker made them, with the targets a transform of (image, target) made of them.
PlainSamples = tuple[list[PlainSample], Made | None]


class RingBatch(TypedDict):
    """The tuned path's batch: its pixels are in ring slot `slot`; only this travels through the queue."""

    slot: int
    # int64 class ids: an array pickled with the batch, not a tensor, which torch hands between processes through
    # a shared-memory file and a socket (a connection accepted by the consumer's thread for every batch)
    labels: np.ndarray
    indices: np.ndarray  # int64 dataset indices of the samples written, in order
    failures: list[tuple[int, str]]  # (index, reason) of the samples that failed
    targets: Made | None  # what a transform of (image, target) made of its samples' targets


class _Samples(torch.utils.data.Dataset):
    """Reads, decodes and transforms samples; lives in the workers."""

    def __init__(self, loader: TorchLoader) -> None:
        self.dataset = loader.dataset
        self.pipeline: PipelineConfig = loader.pipeline
        self.seed = loader.seed
        self.decoder = loader.settings.resolved_decoder()
        self.resize = loader.settings.resolved_resize()
        self.batched = loader.settings.variant == "tuned"
        self.ring = loader._ring  # shared memory: inherited by forked workers, passed by handle otherwise
        self.transform = loader.sample_transform

    def __len__(self) -> int:
        return len(self.dataset)

    def _write(self, item: Item, slot: torch.Tensor) -> None:
        """Decode, crop, resize and flip one sample into `slot` (CHW uint8)."""
        epoch, index, _ = item
        transforms.write_sample(self.dataset.read(index), slot, self.decoder, self.resize, self.pipeline.augment,
                                self.seed, epoch, index, reduced_scale=self.pipeline.jpeg_scale == "reduced",
                                transform=self.transform)

    def __getitem__(self, item: Item) -> PlainSample:
        """The plain path: one sample, CHW float normalised (or uint8 CHW when so configured)."""
        label = int(self.dataset.labels[item[1]])
        size = self.pipeline.image_size
        try:
            if self.resize == "pil":  # as torchvision's PIL transforms + ToTensor + Normalize do
                pixels = transforms.pil_pixels(self.dataset.read(item[1]), self.decoder, self.pipeline.augment,
                                               self.seed, item[0], item[1], size,
                                               self.pipeline.jpeg_scale == "reduced", self.transform)
                if self.pipeline.dtype == "uint8":
                    return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), label, item[1], None
                return transforms.to_normalised_chw(pixels, self.pipeline.mean, self.pipeline.std), label, item[1], None
            chw = torch.empty((3, size, size), dtype=torch.uint8)
            self._write(item, chw)
        except Exception as exc:  # noqa: BLE001 - a bad sample is reported, by policy, in the consumer
            return None, label, item[1], _describe_error(exc)
        if self.pipeline.dtype == "uint8":
            return chw, label, item[1], None
        return transforms.normalise_chw(chw, self.pipeline.mean, self.pipeline.std), label, item[1], None

    def tuned_batch(self, items: list[Item]) -> RingBatch:
        """The tuned path: decode each sample straight into the batch's ring slot (uint8 NHWC: what the
        resize kernel writes as computed and the device's channels-last finishing reads without a transpose)."""
        if self.ring is None:
            raise RuntimeError("the tuned path writes into the batch ring: it is made before the DataLoader")
        out = self.ring[items[0][2]]
        kept: list[int] = []
        failures: list[tuple[int, str]] = []
        for item in items:
            try:
                self._write(item, out[len(kept)].permute(2, 0, 1))
                kept.append(item[1])
            except Exception as exc:  # noqa: BLE001 - reported by policy in the consumer
                failures.append((item[1], _describe_error(exc)))
        indices = np.asarray(kept, dtype=np.int64)
        return {"slot": items[0][2], "labels": np.asarray(self.dataset.labels[indices]), "indices": indices,
                "failures": failures, "targets": self.made_targets()}

    def made_targets(self) -> Made | None:
        """The targets the job's transform of (image, target) made here, sent with the batch to the consumer."""
        return self.transform.made() if self.transform is not None and self.transform.with_target else None

    def __getitems__(self, items: list[Item]) -> RingBatch | PlainSamples:
        # DataLoader calls this for a whole batch when present; the plain variant keeps per-sample calls.
        if self.batched:
            return self.tuned_batch(items)
        samples = [self[item] for item in items]
        return samples, self.made_targets()


def _collate_plain(made: Any) -> WorkerBatch:
    """The plain batch from what `_Samples.__getitems__` made (`PlainSamples`; DataLoader types it a list)."""
    samples: list[PlainSample]
    samples, targets = made
    good = [s for s in samples if s[3] is None]
    failures = [(index, failure) for _, _, index, failure in samples if failure is not None]
    indices = np.asarray([s[2] for s in good], dtype=np.int64)
    if good:
        inputs, labels = default_collate([(s[0], s[1]) for s in good])
    else:
        inputs, labels = torch.empty(0), torch.empty(0, dtype=torch.int64)
    # Plain samples leave the worker finished: float normalised, or uint8 CHW when so configured.
    return {"inputs": inputs, "labels": labels, "indices": indices, "failures": failures, "layout": "NCHW",
            "normalised": True, "targets": targets}


class _BatchPlan:
    """The batch sampler: replays the batches the base class planned (replaced every epoch). The epoch's
    indices stay in numpy arrays; a batch's `(epoch, index, slot)` items are made only as it is handed
    out (a million tuples made up front would be touched by the consumer through the epoch, and with
    them the pages it shares with the workers forked from it: pytorch/pytorch#13246)."""

    def __init__(self) -> None:
        self.batches: Sequence[np.ndarray] = []
        self.epoch = 0
        self.first_slot = 0
        self.slots = 0  # ring slots; 0: no ring (plain), every item's slot is -1

    def plan(self, batches: Sequence[np.ndarray], epoch: int, first_slot: int, slots: int) -> None:
        self.batches, self.epoch, self.first_slot, self.slots = batches, epoch, first_slot, slots

    def __iter__(self) -> Iterator[list[Item]]:
        for k, batch in enumerate(self.batches):
            slot = (self.first_slot + k) % self.slots if self.slots else -1
            yield [(self.epoch, index, slot) for index in batch.tolist()]

    def __len__(self) -> int:
        return len(self.batches)


def _check_sendable(samples: torch.utils.data.Dataset, where: str) -> None:
    """Where worker processes are not forked (a script that set the start method to spawn or forkserver), what they
    read is pickled to them: a dataset object that cannot be is one line naming it, not the DataLoader's traceback."""
    import multiprocessing
    import pickle

    method = multiprocessing.get_start_method(allow_none=True) or "fork"
    if method == "fork":
        return
    try:
        pickle.dumps(samples)
    except Exception as exc:  # noqa: BLE001 - pickle fails in many ways (PicklingError, AttributeError, TypeError)
        raise DatasetError(f"{where}: cannot be sent to the worker processes (start method {method}: they are sent "
                           f"what they read, pickled): {type(exc).__name__}: {str(exc).splitlines()[0]}; make it "
                           "picklable, or use num_workers=0") from None


class TorchLoader(Loader[TorchSettings]):
    name = "torch"
    Settings = TorchSettings
    runs_sample_transform = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings.resolved_decoder()  # an unusable decoder fails at build time, not in a worker
        self._plan = _BatchPlan()
        self._dataloader: DataLoader | None = None
        self._ring: torch.Tensor | None = None
        # What runs: the settings' variant on images; on token windows and records `variant` does not apply.
        self.variant = {"tokens": "memmap", "records": "records"}.get(self.dataset.kind, self.settings.variant)
        self._ring_cursor = 0  # the slot of the next batch to be yielded

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list]:
        # Worker processes up to the cores (0: the consumer decodes); pinning only means something on CUDA.
        workers = [0] + [n for n in (1, 2, 4, 8, 16, 32) if n < cores] + [cores]
        space: dict[str, list[Any]] = {"variant": ["plain", "tuned"], "num_workers": workers, "prefetch_factor": [2, 4]}
        if torch.cuda.is_available():
            space["pin_memory"] = [False, True]
        return space

    @classmethod
    def cpu_demand(cls, settings: TorchSettings) -> int:
        return max(1, settings.num_workers)  # one process per worker, each single-threaded; 0: the consumer

    @classmethod
    def memory_demand(cls, settings: TorchSettings, pipeline: PipelineConfig) -> dict[str, int]:
        """Bytes of shared memory (batches in flight between the workers and the consumer: the tuned ring,
        or collated float batches) this setting holds; pinned when it pins them on CUDA."""
        in_flight = (settings.num_workers * settings.prefetch_factor if settings.num_workers else 0) + 2
        per_batch = pipeline.batch_size * 3 * pipeline.image_size ** 2 * (1 if settings.variant == "tuned" or
                                                                          pipeline.dtype == "uint8" else 4)
        shared = in_flight * per_batch if settings.num_workers or settings.variant == "tuned" else 0
        return {"shared": shared, "pinned": in_flight * per_batch if settings.pin_memory else 0}

    @classmethod
    def supports(cls, dataset) -> tuple[bool, str]:
        return True, ""  # image folders, token corpora (windows from a memmap), records

    def request_paths(self, max_batch: int) -> list[RequestPath]:
        """plain: PIL's decoder and resize; tuned: the fastest decoder with torch's resize, the whole JPEG
        decoded, and again over the crop's region only (the region decoder)."""
        from loadopt.loaders.torch_dl.serving import DecodedRequests

        if self.dataset.kind != "images":
            raise Unservable(f"torch serves image requests; this dataset holds {self.dataset.kind}")
        s, p = self.settings, self.pipeline
        decoder, resize = s.resolved_decoder(), s.resolved_resize()
        if self.variant == "plain":
            return [DecodedRequests("torch plain", p, self.seed, decoder, resize, region=False)]
        name = "torch tuned" + ("" if decoder == "simplejpeg" else f" {decoder}")
        return [DecodedRequests(name, p, self.seed, decoder, resize, region=False),
                DecodedRequests(f"{name} region", p, self.seed, decoder, resize, region=True)]

    def describe(self) -> str:
        s = self.settings
        text = f"{self.variant} num_workers={s.num_workers}"
        if s.num_workers:
            text += f" prefetch={s.prefetch_factor}"
        if s.persistent_workers:
            text += " persistent"
        if s.decoder != "auto":
            text += f" decoder={s.decoder}"
        if s.resize != "auto":
            text += f" resize={s.resize}"
        return text

    def _make_dataloader(self) -> DataLoader:
        s = self.settings
        workers = s.num_workers
        # More workers than cores is a setting a sweep tries on purpose; torch's warning adds nothing.
        warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
        samples: torch.utils.data.Dataset
        collate: Callable[[Any], WorkerBatch | RingBatch]
        if isinstance(self.dataset, TokenDataset):
            samples, collate = TokenWindows(self.dataset), collate_windows
        elif isinstance(self.dataset, RecordDataset):
            samples, collate = RecordSamples(self.dataset), collated
        else:
            samples, collate = _Samples(self), collated if s.variant == "tuned" else _collate_plain
        if workers:
            _check_sendable(samples, self.dataset.root)
        return DataLoader(
            samples,
            batch_sampler=self._plan,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=s.pin_memory and self.device.type == "cuda",
            prefetch_factor=s.prefetch_factor if workers else None,
            persistent_workers=s.persistent_workers and workers > 0,
            worker_init_fn=torch_workers.quiet_when_the_consumer_left,
        )

    def _ring_slots(self) -> int:
        s = self.settings
        return (s.num_workers * s.prefetch_factor if s.num_workers else 0) + 2

    def _make_ring(self) -> torch.Tensor:
        size = self.pipeline.image_size
        ring = torch.empty((self._ring_slots(), self.pipeline.batch_size, size, size, 3), dtype=torch.uint8)
        ring.share_memory_()  # before the workers fork: they write, the consumer reads, same pages
        if self.settings.pin_memory and self.device.type == "cuda":
            # Page-lock the shared ring in place, so the copy to the device is a DMA from pinned memory.
            error = torch.cuda.cudart().cudaHostRegister(ring.data_ptr(), ring.numel(), 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of the batch ring failed with CUDA error {int(error)}")
        return ring

    def produce(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        epoch = self.epoch
        tuned = self.variant == "tuned"
        if tuned and self._ring is None:
            self._ring = self._make_ring()
            self._dataloader = None  # workers must see the ring
        ring = self._ring
        slots = self._ring_slots()
        start = self._ring_cursor
        self._plan.plan(batches, epoch, start, slots if tuned else 0)
        if self._dataloader is None or not self.settings.persistent_workers:
            self._dataloader = self._make_dataloader()
        dataloader = self._dataloader
        # Persistent workers that died since the last pass fail this one's start (torch's _reset waits for them).
        iterator = self._next_or_died(lambda: iter(dataloader), getattr(dataloader, "_iterator", None), 0)
        if self.settings.num_workers > 0:
            torch_workers.watch(iterator)
        previous: HostBatch | None = None
        done = 0
        try:
            while True:
                if previous is not None and previous.copy_done is not None:
                    # Taking the next batch lets the DataLoader hand a ring slot out again: the
                    # asynchronous device copies from the slots (in order on one stream) must be done.
                    previous.copy_done.synchronize()
                try:
                    out = self._next_or_died(lambda: next(iterator), iterator, done)
                except StopIteration:
                    break
                done += 1
                if ring is not None and tuned:
                    self._ring_cursor = (self._ring_cursor + 1) % slots
                    ringed: RingBatch = out
                    self._give_targets(ringed["targets"])
                    inputs = ring[ringed["slot"]][: len(ringed["indices"])]
                    previous = HostBatch(inputs, torch.from_numpy(ringed["labels"]), ringed["indices"], "NHWC",
                                         normalised=False, failures=ringed["failures"], borrowed=True)
                    yield previous
                else:
                    batch: WorkerBatch = out
                    self._give_targets(batch.get("targets"))
                    labels = batch["labels"]
                    if labels is None:  # records: no labels, made here (see RecordSamples)
                        labels = torch.zeros(len(batch["indices"]), dtype=torch.int64)
                    yield HostBatch(batch["inputs"], labels, batch["indices"], batch["layout"], batch["normalised"],
                                    batch["failures"], bytes_read=batch.get("bytes_read"))
        finally:
            torch_workers.unwatch(iterator)
            if not self.settings.persistent_workers:
                shutdown = getattr(iterator, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
                self._dataloader = None

    def _give_targets(self, made: Made | None) -> None:
        """Targets a worker's transform of (image, target) made, to the consumer's transform, which takes them with
        the batch (`Loader.host_batches`)."""
        if made and self.sample_transform is not None:
            self.sample_transform.give(made)

    def _next_or_died(self, step: Callable[[], Any], iterator: Any, done: int) -> Any:
        """`step()` (the DataLoader's next batch, or a new pass), a worker that died under it raised as
        `WorkerDied` naming it: torch's own error is a `RuntimeError` from its SIGCHLD handler or, where a
        batch's shared memory was to come from the dead worker, a `ConnectionResetError`."""
        try:
            return step()
        except (RuntimeError, ConnectionError, EOFError) as exc:
            # A worker's own exception comes back as a RuntimeError too ("Caught ... in DataLoader worker"):
            # only torch's words for a death, or a broken connection, are worth looking for a dead worker.
            death = not isinstance(exc, RuntimeError) or any(words in str(exc) for words in torch_workers.DEATH_WORDS)
            died = torch_workers.dead_worker(iterator) if death else None
            if died is None:
                raise
            self._dataloader = None  # its workers cannot serve another pass: the next one starts new ones
            raise WorkerDied(f"torch: DataLoader {died}; the pass stopped after {done} of its batches") from exc

    def close(self) -> None:
        if self._dataloader is not None:
            iterator = getattr(self._dataloader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
            self._dataloader = None
        # The shared batch ring (tuned): unmapped now, not when the loader object goes (a script keeps it
        # after close(); benchmarks/soak.py found it still mapped). A later pass makes a new one.
        self._ring = None
