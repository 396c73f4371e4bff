"""One filler per stored form: what turns a batch's stored bytes into a ring slot, for every ring backend.

A ring backend (arrow, posix, kvikio) supplies only where each sample's stored bytes are (`Located`: arrow's
views of its mapped file, posix's staging buffer or shard mappings, kvikio's device staging); the filler of the
conversion's stored form, chosen once when the loader is made (`RingLoader.filler`), fills a slot from them and
says what it read (`Filled`). The forms:
- `CentreSquares` (decoded): the crop of a stored square copied (`crops.crop_batch`);
- `WholeFrames` (frames): the JPEG paths' crop box of a whole frame, resized and flipped (`crops.crop_frames`);
- `EncodedJpegs` (encoded) and `Reencoded` (reencoded: bounded by max_side): decoded by the shared pipeline;
- `TokenWindows` (tokens): int64 inputs and targets gathered from the stored windows;
- `Records` (records): each record's first `delivered_bytes`, zero-padded.
The device variants (kvikio: torch ops on the staging buffer's device) are the `kvikio` backend's own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, TypeVar

import numpy as np
import torch

from loadopt.config_models import PipelineConfig
from loadopt.errors import DatasetError
from loadopt.loaders import crops, transforms
from loadopt.loaders.base import HostBatch, Layout
from loadopt.loaders.sample_transform import SampleTransform
from loadopt.storage.dataset import Dataset
from loadopt.storage.sources.records import RecordDataset
from loadopt.storage.sources.tokens import TokenDataset

if TYPE_CHECKING:
    from loadopt.loaders.crop_processes import CropProcesses
    from loadopt.loaders.transforms import DeviceDecoder

BufferT = TypeVar("BufferT", np.ndarray, torch.Tensor)
Failures = list[tuple[int, str]]


@dataclass(frozen=True)
class Located(Generic[BufferT]):
    """Where a batch's stored bytes are: batch position k's are `lengths[k]` bytes at byte `starts[k]` of
    `sources[which[k]]` (host arrays, or device tensors for the device fillers)."""

    sources: Sequence[BufferT]
    which: np.ndarray  # per position: its source
    starts: np.ndarray  # int64 byte offsets in it
    lengths: np.ndarray  # int64 stored lengths
    nbytes: int  # bytes read from storage for them (the backend's reads: aligned runs, stored rows)
    frames: np.ndarray | None = None  # whole frames: (height, width, source height, source width) per position
    mapped: bool = False  # views of a file's mapping: a page is read from storage only when touched

    def bytes_of(self, k: int) -> BufferT:
        start = int(self.starts[k])
        return self.sources[int(self.which[k])][start : start + int(self.lengths[k])]


class Filled(NamedTuple):
    """What a filler put in a slot: its samples, those that could not be decoded, the bytes read for them."""

    indices: np.ndarray
    failures: Failures
    bytes_read: int | None


@dataclass(frozen=True)
class FillContext:
    """What a filler needs of its loader, given once when it is made."""

    backend: str  # the loader's name, for messages
    pipeline: PipelineConfig
    dataset: Dataset
    seed: int
    threads: int  # threads sharing a batch's crops or decodes
    size: int | None  # the stored pixel size (centre squares: the side; whole frames: the longer side's bound)
    decoder: str = "simplejpeg"  # the CPU JPEG decoder (`transforms.decoder_name`)
    # raises where a sample that failed to decode is damaged in the conversion itself (not the source's fault)
    damaged: Callable[[int], None] | None = None
    # the GPU decoder and its name, or None and why (the device fillers of the encoded forms)
    device_decoder: Callable[[], tuple[DeviceDecoder | None, str]] | None = None
    transform: SampleTransform | None = None  # the job's own per-sample transform (`pipeline.transform`)


class Filler(ABC, Generic[BufferT]):
    """Fills a ring slot with a batch of one stored form from located bytes (`fill`), and makes the host
    batch over the slot (`batch`); `slot_shape` is the ring's."""

    layout: ClassVar[Layout] = "NHWC"  # image slots are HWC: crops of rows are row copies
    # Each sample's bytes are read once an epoch: a backend reading them from a mapping lets go of its pages
    # every `TRIM_EVERY` batches (they stay in the page cache) rather than keep them counted in its memory.
    release_mapped: ClassVar[bool] = False
    # Read through the page cache from the shards' mappings (posix), where the native module is there:
    # `staged` batches; `mapped batches` cropped straight from the mappings when all cached (the crop reads
    # only its box); `per sample` read and cropped in C (`posix_cache.PageCacheCrops`).
    page_cache_path: ClassVar[str] = "staged"
    # Read into host memory even by a backend that reads into the device's (kvikio): the GPU JPEG decoders
    # parse bitstreams on the host.
    bytes_on_host: ClassVar[bool] = False

    def __init__(self, context: FillContext) -> None:
        self.context = context

    def slot_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        """One slot's shape and dtype: a batch of HWC uint8 images."""
        size = self.context.pipeline.image_size
        return (self.context.pipeline.batch_size, size, size, 3), torch.uint8

    @abstractmethod
    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located[BufferT], epoch: int,
             pool: Executor | None) -> Filled:
        """Fill `slot` with the samples `indices` from their `located` bytes (`pool`: threads to share it)."""

    def send(self, croppers: CropProcesses, slot: int, indices: np.ndarray, located: Located[BufferT], epoch: int,
             release: bool) -> None:
        """Hand the batch to the crop worker processes instead (a form they crop or decode)."""
        raise NotImplementedError(f"{type(self).__name__}: not filled by worker processes")

    def transformed(self, slot: torch.Tensor, indices: np.ndarray, epoch: int) -> Failures:
        """The job's own transform over a slot loadopt's crop filled (`pipeline.transform`), in place; the samples
        it failed. Nothing to do without one."""
        c = self.context
        if c.transform is None:
            return []
        return c.transform.apply_to_slots(slot.numpy(), indices, c.seed, epoch)

    def batch(self, slot: torch.Tensor, indices: np.ndarray, failures: Failures, bytes_read: int | None) -> HostBatch:
        """The host batch over a filled slot: its images but those that failed (their positions hold garbage)."""
        labels = self.context.dataset.labels
        if not failures:  # the common case, for every batch: no mask to build
            return HostBatch(slot[: len(indices)], torch.from_numpy(labels[indices]), indices, self.layout,
                             normalised=False, failures=failures, bytes_read=bytes_read, borrowed=True)
        failed = {index for index, _ in failures}
        kept = np.array([index not in failed for index in indices.tolist()], dtype=bool)
        inputs = slot[: len(indices)][torch.from_numpy(kept)]
        return HostBatch(inputs, torch.from_numpy(labels[indices[kept]]), indices[kept],
                         self.layout, normalised=False, failures=failures, bytes_read=bytes_read, borrowed=True)


class CentreSquares(Filler[np.ndarray]):
    """Decoded centre squares (`decoded`): a random (train) or the centre (eval) crop copied, flipped by plan."""

    page_cache_path = "per sample"

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located[np.ndarray], epoch: int,
             pool: Executor | None) -> Filled:
        c = self.context
        assert c.size is not None, "centre squares are stored at a size"
        crops.crop_batch(slot.numpy(), indices, located.sources, located.which, located.starts, c.size,
                         c.pipeline.augment, c.seed, epoch, pool, c.threads)
        return Filled(indices, self.transformed(slot, indices, epoch), located.nbytes)


class WholeFrames(Filler[np.ndarray]):
    """Decoded whole frames (`frames`): the JPEG paths' crop box, resized and flipped."""

    page_cache_path = "mapped batches"

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located[np.ndarray], epoch: int,
             pool: Executor | None) -> Filled:
        c = self.context
        assert located.frames is not None, "whole frames are located with their dims"
        crops.crop_frames(slot.numpy(), indices, located.sources, located.which, located.starts, located.frames,
                          c.pipeline.augment, c.seed, epoch, pool, c.threads)
        return Filled(indices, self.transformed(slot, indices, epoch), located.nbytes)

    def send(self, croppers: CropProcesses, slot: int, indices: np.ndarray, located: Located[np.ndarray], epoch: int,
             release: bool) -> None:
        assert located.frames is not None, "whole frames are located with their dims"
        croppers.send(slot, indices, located.which, located.starts, located.frames, self.context.pipeline.augment,
                      self.context.seed, epoch)


class EncodedJpegs(Filler[np.ndarray]):
    """Stored JPEGs (`encoded`: the sources' with restart markers): decoded, cropped, resized and flipped by
    the pipeline every backend shares (`transforms.decode_batch`)."""

    release_mapped = True

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located[np.ndarray], epoch: int,
             pool: Executor | None) -> Filled:
        c = self.context
        places, sizes, sourced = located.starts.tolist(), located.lengths.tolist(), located.which.tolist()
        views: dict[int, memoryview] = {}  # the sources the batch reads (slices of memoryviews copy nothing)

        def sample(k: int) -> memoryview:
            view = views.get(sourced[k])
            if view is None:
                view = views[sourced[k]] = memoryview(located.sources[sourced[k]])
            return view[places[k] : places[k] + sizes[k]]

        failures = transforms.decode_batch(slot, indices, sample, c.decoder, c.pipeline.augment, c.seed, epoch,
                                           reduced_scale=c.pipeline.jpeg_scale == "reduced", pool=pool,
                                           threads=c.threads, damaged=c.damaged, transform=c.transform)
        return Filled(indices, failures, located.nbytes)

    def send(self, croppers: CropProcesses, slot: int, indices: np.ndarray, located: Located[np.ndarray], epoch: int,
             release: bool) -> None:
        c = self.context
        croppers.send_decode(slot, indices, located.which, located.starts, located.lengths, c.decoder,
                             c.pipeline.augment, c.seed, epoch, c.pipeline.jpeg_scale == "reduced", release=release)


class Reencoded(EncodedJpegs):
    """JPEGs bounded by max_side (`reencoded`: a larger source re-encoded, FFCV's jpg input): decoded as the
    encoded form's."""


class TokenWindows(Filler[np.ndarray]):
    """Token windows (`tokens`): each window's ids as int64 inputs and, shifted by one, targets."""

    layout = "tokens"

    def __init__(self, context: FillContext) -> None:
        super().__init__(context)
        assert isinstance(context.dataset, TokenDataset), "token windows fill from a token corpus"
        self.tokens = context.dataset

    def slot_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        return (2, self.context.pipeline.batch_size, self.tokens.seq_len), torch.int64

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located[np.ndarray], epoch: int,
             pool: Executor | None) -> Filled:
        dtype = self.tokens.tokens.dtype
        n, width = len(indices), int(located.lengths[0]) // dtype.itemsize  # fixed-size windows
        offsets, misaligned = np.divmod(located.starts, dtype.itemsize)
        if misaligned.any():
            raise DatasetError("stored token windows are not aligned to their dtype (a corrupt file?)")
        if len(located.sources) == 1:  # one gather for the whole batch
            windows = np.asarray(located.sources[0]).view(dtype)[offsets[:, None] + np.arange(width)]
        else:
            windows = np.stack([np.asarray(located.sources[int(w)]).view(dtype)[int(o) : int(o) + width]
                                for w, o in zip(located.which, offsets, strict=True)])
        slot[0].numpy()[:n] = windows[:, :-1]
        slot[1].numpy()[:n] = windows[:, 1:]
        return Filled(indices, [], located.nbytes)

    def batch(self, slot: torch.Tensor, indices: np.ndarray, failures: Failures, bytes_read: int | None) -> HostBatch:
        n = len(indices)  # (inputs, targets) pairs
        return HostBatch(slot[0][:n], slot[1][:n], indices, "tokens", bytes_read=bytes_read, borrowed=True)


class Records(Filler[np.ndarray]):
    """Records (`records`): each stored whole, its first `delivered_bytes` delivered into a
    (batch, delivered_bytes) uint8 row, zero-padded (DLIO's `record_length_bytes_resize`), as the `torch`
    backend delivers them; every byte of a record is read from storage (the workload is the record's size)."""

    layout = "records"

    def __init__(self, context: FillContext) -> None:
        super().__init__(context)
        assert isinstance(context.dataset, RecordDataset), "records fill from record files"
        self.records = context.dataset

    def slot_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        return (self.context.pipeline.batch_size, self.records.delivered_bytes), torch.uint8

    def fill(self, slot: torch.Tensor, indices: np.ndarray, located: Located[np.ndarray], epoch: int,
             pool: Executor | None) -> Filled:
        stored = [located.bytes_of(k) for k in range(len(indices))]
        for row, record in zip(slot.numpy(), stored, strict=False):
            self.records.deliver(record, row)
        wanted = self.records.delivered_bytes
        rest = max((len(r) - wanted for r in stored), default=0)
        if located.mapped and rest > 0:  # the rest of each record read too (its pages touched), as staged reads do
            scratch = np.empty(rest, np.uint8)
            for r in stored:
                scratch[: max(0, len(r) - wanted)] = r[wanted:]
        return Filled(indices, [], located.nbytes)

    def batch(self, slot: torch.Tensor, indices: np.ndarray, failures: Failures, bytes_read: int | None) -> HostBatch:
        n = len(indices)  # records carry no labels
        return HostBatch(slot[:n], torch.zeros(n, dtype=torch.int64), indices, "records", normalised=True,
                         bytes_read=bytes_read, borrowed=True)


# The host filler of each stored form (`Form`).
HOST_FILLERS: Mapping[str, type[Filler]] = {
    "decoded": CentreSquares, "frames": WholeFrames, "encoded": EncodedJpegs, "reencoded": Reencoded,
    "tokens": TokenWindows, "records": Records,
}
