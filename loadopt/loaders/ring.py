"""A producer thread filling the slots of a preallocated batch ring, and its consumer side.

Shared by the backends that assemble batches in the consumer process (arrow, posix, kvikio). The
producer takes a free slot, fills it and puts `(slot, ...)` on the ready queue (or the exception it
hit: never swallowed, raised in the consumer). The consumer hands a slot back only when the next
batch is asked for, and only once an asynchronous device copy from it (CUDA) has finished.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar, Literal, TypeVar

import numpy as np
import psutil
import torch
from pydantic import BaseModel, ConfigDict, Field

from loadopt.config_models import PipelineConfig
from loadopt.imaging.reencode import REENCODE_QUALITY
from loadopt.loaders.base import HostBatch, Layout, Loader, WorkKind
from loadopt.loaders.crop_processes import CropProcesses, fork_available
from loadopt.loaders.fillers import HOST_FILLERS, FillContext, Filler, WholeFrames
from loadopt.loaders.transforms import decoder_name
from loadopt.recipe import Recipe
from loadopt.storage.dataset import Dataset
from loadopt.storage.forms import conversions, placement
from loadopt.storage.sources.records import RecordDataset
from loadopt.storage.sources.tokens import TokenDataset

Producer = Callable[[queue.Queue, queue.Queue, threading.Event], None]
log = logging.getLogger(__name__)


def ring_batches(count: int, slots: int, produce: Producer, make_batch: Callable[..., HostBatch],
                 name: str) -> Iterator[HostBatch]:
    """Run `produce(free, ready, stop)` in a thread and yield `make_batch(*item)` for `count` items."""
    free: queue.Queue = queue.Queue()
    for slot in range(slots):
        free.put(slot)
    ready: queue.Queue = queue.Queue()
    stop = threading.Event()
    producer = threading.Thread(target=_guarded, args=(produce, free, ready, stop), name=name, daemon=True)
    producer.start()
    previous: tuple[int, HostBatch] | None = None
    try:
        for _ in range(count):
            if previous is not None:
                if previous[1].copy_done is not None:
                    previous[1].copy_done.synchronize()  # an async device copy still reads the slot
                free.put(previous[0])
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            batch = make_batch(*item)
            yield batch
            previous = (item[0], batch)
    finally:
        stop.set()
        free.put(None)  # wakes a producer waiting for a slot
        producer.join()


def _guarded(produce: Producer, free: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
    try:
        produce(free, ready, stop)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, never swallowed
        ready.put(exc)


def next_slot(free: queue.Queue, stop: threading.Event) -> int | None:
    """The next free slot for a producer, or None when the consumer has stopped."""
    slot = free.get()
    return None if slot is None or stop.is_set() else slot


class RingSettings(BaseModel):
    """The knobs every ring backend has: its `Settings` subclass this and add their own."""

    model_config = ConfigDict(extra="forbid")

    form: Literal["decoded", "encoded"] = "decoded"  # token datasets are always stored as windows
    decoded_size: int | None = Field(None, ge=8)  # frame centre: image_size / 0.875 (256 for 224)
    # decoded: `whole` frames (longer side <= pipeline.max_side) or `centre` squares; auto: whole for train
    frame: Literal["auto", "whole", "centre"] = "auto"
    prefetch: int = Field(2, ge=1)  # batches assembled ahead of the consumer
    # Whole frames: cropped by worker processes (one GIL each, `crop_processes`) or by threads of this one
    # (threads on CUDA, whose ring is pinned, and where fork is unavailable).
    crop_in: Literal["processes", "threads"] = "processes"


RingSettingsT = TypeVar("RingSettingsT", bound=RingSettings)


class RingLoader(Loader[RingSettingsT]):
    """A backend that reads a converted form of the dataset (`decoded` pixels, `encoded` JPEGs, token
    windows, records) into a ring of batch slots; its Settings subclass `RingSettings` (`form`,
    `decoded_size`, `frame`, `prefetch`).
    A subclass implements `is_open` and `fill_ring` (the producer thread), which fills each slot with the
    stored form's `filler` from where the backend has the batch's bytes (`fillers.Located`); `ring_batch`
    makes the batch over a slot, `produce` runs them and hands each slot back once its batch's device copy
    is done (docs/plugins.md)."""

    # The filler of each stored form; a backend finishing batches elsewhere (kvikio) has its own.
    fillers: ClassVar[Mapping[str, type[Filler]]] = HOST_FILLERS
    # The fillers this backend hands to worker processes (`crops_in_processes`; `frame_sources` gives them
    # their bytes): whole frames by default; the Arrow backend its encoded JPEGs too.
    worker_fillers: ClassVar[tuple[type[Filler], ...]] = (WholeFrames,)
    runs_sample_transform = True  # by the host fillers, on what they crop or decode

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # What it reads, resolved as `loadopt convert` resolves it (`converted_form`): the decoded
        # frame (`whole`: longer side <= pipeline.max_side, the JPEG paths' crop plan; `centre`: a
        # decoded_size square, the eval recipe; auto: whole for train), the stored form and the pixel size;
        # token windows and records whatever the settings ask for.
        converted = conversions.converted_form(self.pipeline, self.settings.form, self.settings.decoded_size,
                                               self.settings.frame, isinstance(self.dataset, TokenDataset),
                                               where=f"loaders.{self.name}.decoded_size",
                                               records=isinstance(self.dataset, RecordDataset))
        self.form, self.frame, self.stored_form, self.size = \
            converted.form, converted.frame, converted.stored, converted.size
        self.filler_class = self.fillers[self.stored_form]  # the stored form's, made on first use (`filler`)
        self._filler: Filler | None = None
        self._ring: list[torch.Tensor] | None = None
        self._croppers: CropProcesses | None = None
        self._croppers_refused = False  # worker processes could not start here: threads crop

    @classmethod
    def work_kind(cls, settings: RingSettingsT, recipe: Recipe | None = None) -> str:
        """The recipe's work (`Loader.work_kind`); the encoded form's JPEGs are the stored ones, with restart
        markers (`imaging.reencode.with_restarts`): held to their own decode ceiling."""
        kind = super().work_kind(settings, recipe)
        if kind == WorkKind.JPEG_DECODE and settings.form == "encoded":
            return WorkKind.STORED_JPEG_DECODE.value
        return kind

    @classmethod
    def supports(cls, dataset: Dataset) -> tuple[bool, str]:
        return True, ""  # image folders, token corpora and records: each converted to a form with a filler

    @classmethod
    def runs_pipeline(cls, pipeline: PipelineConfig, settings: RingSettingsT) -> tuple[bool, str]:
        """`augment: none` hands the job's transform the source image: the decoded forms hold crops or frames
        bounded by `max_side`, so only the encoded form has it."""
        runs, why = super().runs_pipeline(pipeline, settings)
        if runs and pipeline.augment == "none" and settings.form != "encoded":
            return False, (f"{cls.name} form {settings.form}: augment: none hands pipeline.transform the source "
                           "image, which only the encoded form stores (form: encoded)")
        return runs, why

    def recipe(self) -> Recipe:
        from loadopt import recipe

        if self.frame is None:  # token windows, records, the sources' own JPEGs
            return super().recipe()
        # the encoded form bounded by max_side: JPEGs over it re-encoded (`bounded_jpeg`), as FFCV's jpg
        reencoded = REENCODE_QUALITY if self.stored_form == "reencoded" else None
        return recipe.delivered(self.pipeline, self.frame, self.size, reencoded_quality=reencoded)

    @property
    def layout(self) -> Layout:
        # Image slots are HWC: crops of decoded rows are row copies, and a JPEG's crop is resized as the
        # kernel computes it (channels-last); the device's channels-last finishing reads them untransposed.
        return self.filler_class.layout

    def stored_text(self) -> str:
        """What is read, for `describe`: the form, and a decoded frame's kind and size."""
        return self.form + (f" {self.frame} {self.size}px" if self.size else "")

    @property
    def filler(self) -> Filler:
        """The stored form's filler (`fillers`), made once, on first use (`open_filler`)."""
        return self.open_filler()

    def open_filler(self) -> Filler:
        """Make the stored form's filler, once (it raises where the form cannot be filled here)."""
        if self._filler is None:
            self._filler = self.filler_class(self.fill_context())
        return self._filler

    def fill_context(self) -> FillContext:
        """What the filler needs of this loader (a backend adds its own: a damage check, a GPU decoder)."""
        return FillContext(self.name, self.pipeline, self.dataset, self.seed, getattr(self.settings, "threads", 1),
                           self.size, decoder_name(getattr(self.settings, "decoder", "auto")),
                           transform=self.sample_transform)

    @abstractmethod
    def is_open(self) -> bool:
        """Whether `prepare` has opened the converted form (the producer reads it)."""

    @abstractmethod
    def fill_ring(self, batches: Sequence[np.ndarray], epoch: int, free: queue.Queue, ready: queue.Queue,
                  stop: threading.Event) -> None:
        """Fill free slots with `batches` in order; put `(slot, indices, failures[, ...])` on `ready`."""

    def ring_batch(self, slot: int, indices: np.ndarray, failures: list[tuple[int, str]],
                   bytes_read: int | None = None) -> HostBatch:
        """The batch over a filled slot, from what the producer put on `ready` (`fillers.Filled`)."""
        assert self._ring is not None, "produce() makes the ring before the producer fills it"
        return self.filler.batch(self._ring[slot], indices, failures, bytes_read)

    def frame_sources(self) -> list[np.ndarray] | None:
        """The stored bytes of a filler in `worker_fillers` (whole frames; encoded JPEGs), as the arrays the
        workers' `which` indexes, for them to inherit; None where this backend reads none from memory."""
        return None

    def crops_in_processes(self) -> bool:
        """Whether worker processes crop (or decode) the stored form (`crop_in`, for a filler in
        `worker_fillers`), writing into a ring in shared memory: not on CUDA (the ring is pinned there),
        nor where fork is unavailable, nor on a tier (read through it batch by batch, not mapped)."""
        return self.settings.crop_in == "processes" and issubclass(self.filler_class, self.worker_fillers) and \
            self.device.type != "cuda" and fork_available() and placement.conversion_tier(self.dataset) is None

    @property
    def croppers(self) -> CropProcesses | None:
        """The crop workers of this epoch, where `crops_in_processes` (started by `produce`)."""
        return self._croppers

    def start_workers(self, ring: list[torch.Tensor]) -> None:
        """Fork the crop workers (once; again if one died), from the consumer's thread before the producer
        thread starts: they inherit the ring and `frame_sources`."""
        if not self.crops_in_processes() or (self._croppers is not None and self._croppers.alive()):
            return
        if self._croppers is not None:  # one died between epochs (none was cropping): said, then replaced
            log.warning("%s: crop worker process %s died between epochs (out of memory, or killed); replaced",
                        self.name, ", ".join(self._croppers.dead()))
        self.stop_workers()
        sources = self.frame_sources()
        if sources is not None and not self._croppers_refused:
            count = getattr(self.settings, "threads", 1)  # as many as the threads that would crop
            try:
                # Frames that fit in half the memory available are mapped whole into each worker at its start
                # (`crop_processes.populate`): no page faults in its first epochs.
                fits = sum(source.nbytes for source in sources) <= psutil.virtual_memory().available // 2
                self._croppers = CropProcesses([slot.numpy() for slot in ring], sources, count, map_all=fits,
                                               transform=self.sample_transform)
            except (AssertionError, OSError, ValueError) as exc:  # e.g. inside a daemonic process: no children
                self._croppers_refused = True
                log.warning("%s: whole frames cropped by threads, worker processes could not start (%s)",
                            self.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    def stop_workers(self) -> None:
        """Close the crop workers (a backend calls it when the frames they inherited are unmapped)."""
        if self._croppers is not None:
            self._croppers.close()
            self._croppers = None

    def produce(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        if not self.is_open():
            self.prepare()
        if self._ring is None:
            self._ring = self._make_ring()
        self.start_workers(self._ring)
        epoch = self.epoch
        return ring_batches(len(batches), len(self._ring),
                            lambda free, ready, stop: self.fill_ring(batches, epoch, free, ready, stop),
                            self.ring_batch, f"loadopt-{self.name}")

    @classmethod
    def memory_demand(cls, settings: RingSettingsT, pipeline: PipelineConfig) -> dict[str, int]:
        """The batch ring (`prefetch` + 2 slots of uint8 batches), pinned on CUDA; staging is ordinary memory."""
        return {"shared": 0, "pinned": (settings.prefetch + 2) * pipeline.batch_size * 3 * pipeline.image_size ** 2}

    def _make_ring(self) -> list[torch.Tensor]:
        """`prefetch` + 2 slots of the filler's shape: in shared memory for crop workers, pinned on CUDA."""
        slot, dtype = self.filler.slot_shape()
        shape = (self.settings.prefetch + 2, *slot)
        if self.crops_in_processes():
            return list(shared_empty(shape, dtype))
        ring = torch.empty(shape, dtype=dtype)
        return list(ring.pin_memory() if self.device.type == "cuda" else ring)


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared anonymous memory: forked processes write into the same pages
    (freed with the last mapping: nothing in /dev/shm to leave behind)."""
    nbytes = max(1, int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size())
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).reshape(shape)  # the tensor holds the mapping
