"""The `arrow` backend: samples stored once in a memory-mapped Arrow IPC file.

Reading a sample costs a page-cache hit and a copy: no file opens, no per-sample Python objects.
A producer thread assembles each batch straight into a slot of a preallocated ring (pinned where
CUDA is there), `prefetch` batches ahead, with `threads` threads sharing each batch:
- decoded pixels: whole frames (train): the JPEG paths' crop box scaled into stored pixels, resized
  and flipped (`crops.crop_frames`); centre squares (eval, or `frame: centre`): a crop copied from the
  mapped rows;
- encoded JPEGs: decoded in the threads (simplejpeg and torch's resize release the GIL) with the
  same pipeline as the `torch` backend, so both deliver equal tensors;
- token windows: gathered per record batch with numpy fancy indexing into int64 inputs/targets;
- records (`dataset.kind: records`): the `records` form holds each record whole; its first `delivered_bytes`
  are copied into the slot's row and the rest read into a scratch buffer (every byte of a record is read
  from storage, as the `torch` and `posix` backends read it: the workload is the record's size).
Errors in the producer reach the consumer as exceptions (a bad sample by the `on_error` policy).

On a tier that is not plain local disk (emulated, or remote storage) the file is not memory-mapped:
its image in anonymous memory (`tier_reads.ShadowFile`) gets each batch's samples fetched through the
tier (`io_threads` range requests in flight, the next batch's while this one is assembled), so the
tier's limits and counters see every byte, and the views and fills above run unchanged.
"""

from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from loadopt.errors import DatasetError
from loadopt.imaging.frames import FRAME_FIELDS
from loadopt.loaders import crops, record_ring, transforms
from loadopt.loaders.base import TRIM_EVERY, HostBatch
from loadopt.loaders.ring import RingLoader, RingSettings, next_slot, slot_batch
from loadopt.storage import arrow_format, tier_reads
from loadopt.storage.arrow_format import ROWS_PER_BATCH, ArrowConversion, arrow_path, convert, open_arrow
from loadopt.storage.pagecache import release_pages
from loadopt.storage.tokens import TokenDataset


class ArrowSettings(RingSettings):
    # form, decoded_size, frame, prefetch: RingSettings
    threads: int = Field(2, ge=1)  # threads sharing each batch: decode (encoded) or crop copies (decoded)
    decoder: Literal["auto", "pil", "simplejpeg"] = "auto"  # encoded form
    io_threads: int = Field(8, ge=1)  # range requests in flight on a tier that is not the local disk


class ArrowLoader(record_ring.RecordsInRing, RingLoader[ArrowSettings]):
    name = "arrow"
    Settings = ArrowSettings
    worker_forms = ("frames", "encoded", "reencoded")  # the mapped file's JPEGs are decoded by workers too

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._views: list[Any] | None = None  # per record batch: numpy views of its samples (`_view`)
        self._conversion: ArrowConversion | None = None  # the opened file's record batches and checksums
        self._windows: tuple[np.ndarray, np.ndarray, int] | None = None  # tokens: see `_windows_view`
        self._shadow: tier_reads.ShadowFile | None = None  # on a tier: the file's image, fetched through it
        self._frames: tuple[np.ndarray, np.ndarray] | None = None  # whole frames: `_frame_table`
        self._jpegs: tuple[np.ndarray, np.ndarray] | None = None  # the encoded form's: `_encoded_table`

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list]:
        # The stored form is the reader variant (decoded pixels: copies; encoded JPEGs: decode in threads).
        return {"form": ["decoded", "encoded"], "threads": [n for n in (1, 2, 4, 8, 16, 32) if n < cores] + [cores],
                "prefetch": [1, 2, 4]}

    @classmethod
    def cpu_demand(cls, settings: ArrowSettings) -> int:
        return settings.threads  # the pool sharing each batch; the producer thread only hands out work

    def reads_conversion(self) -> bool:
        return True

    def describe(self) -> str:
        s = self.settings
        text = "records" if self._records else self.form + (f" {self.frame} {self.size}px" if self.size else "")
        return f"{text} threads={s.threads} prefetch={s.prefetch}" + tier_reads.via_tier(self.dataset, conversion=True)

    # -- the file ------------------------------------------------------------------------------

    def prepare(self, progress=None, convert_missing: bool = True) -> None:
        self.stop_workers()  # they inherited the views this replaces
        self._frames = self._jpegs = None
        path = arrow_path(self.dataset, self.stored_form, self.size)
        if not path.exists():
            if not convert_missing:
                raise DatasetError(f"{path}: no Arrow conversion of {self.dataset.root} ({self.form}); run "
                                   f"`loadopt convert CONFIG --to arrow{' --decoded' if self.size else ''}`")
            convert(self.dataset, self.stored_form, self.size, progress=progress, on_error=self.on_error)
        conversion = open_arrow(path, self.dataset, self.stored_form, self.size)
        self.unreadable, self._conversion = conversion.skipped, conversion  # samples the conversion skipped
        batches: list[pa.RecordBatch] = conversion
        remote = tier_reads.publish(self.dataset, path)
        tier = tier_reads.conversion_tier(self.dataset)
        if tier is not None:  # every byte through the tier: no memory map of the file
            self._shadow = tier_reads.ShadowFile(tier, remote or str(path), path, self.settings.io_threads)
            batches = self._shadow.record_batches()
        self._views = [self._view(b) for b in batches]
        if isinstance(self.dataset, TokenDataset):
            self._windows = _windows_view(batches, self.dataset.tokens.dtype)

    def storage_files(self) -> list[str]:
        if tier_reads.remote_home(self.dataset) is not None:
            return []  # read from the dataset's storage: no local page cache to evict
        return [str(arrow_path(self.dataset, self.stored_form, self.size))]

    def _view(self, batch):
        """Zero-copy numpy views of one record batch's sample column."""
        column = batch.column(batch.num_columns - 1)
        rows = batch.num_rows
        if self.stored_form == "frames":  # (pixel offsets, pixel data, (rows, 4) int32 dims)
            offsets = np.frombuffer(column.buffers()[1], np.int64, rows + 1, column.offset * 8)
            dims = np.stack([batch.column(name).to_numpy() for name in FRAME_FIELDS], axis=1)
            return offsets, np.frombuffer(column.buffers()[2], np.uint8), dims
        if self._records:  # large binary: int64 offsets
            offsets = np.frombuffer(column.buffers()[1], np.int64, rows + 1, column.offset * 8)
            return offsets, np.frombuffer(column.buffers()[2], np.uint8)
        if self.form == "encoded":
            offsets = np.frombuffer(column.buffers()[1], np.int32, rows + 1, column.offset * 4)
            return offsets, np.frombuffer(column.buffers()[2], np.uint8)
        width = column.type.byte_width
        data = np.frombuffer(column.buffers()[1], np.uint8, rows * width, column.offset * width)
        if isinstance(self.dataset, TokenDataset):
            return data.view(self.dataset.tokens.dtype).reshape(rows, -1)
        return data.reshape(rows, self._square(), self._square(), 3)

    # -- batches -------------------------------------------------------------------------------

    @property
    def views(self) -> list[Any]:
        """Per record batch, numpy views of its samples (`_view`); `prepare` opens them."""
        assert self._views is not None, "prepare() opens the Arrow file"
        return self._views

    def _square(self) -> int:
        """The side of the stored centre squares (the decoded form)."""
        assert self.size is not None, "the decoded form is stored at a size"
        return self.size

    def _slot(self, slot: int) -> torch.Tensor:
        assert self._ring is not None, "produce() makes the ring before the producer fills it"
        return self._ring[slot]

    def _fill_tokens(self, slot: torch.Tensor, indices: np.ndarray) -> None:
        assert self._windows is not None, "prepare() maps a token corpus's windows"
        tokens, starts, width = self._windows
        windows = tokens[starts[indices][:, None] + np.arange(width)]  # one gather for the whole batch
        n = len(indices)
        slot[0].numpy()[:n] = windows[:, :-1]
        slot[1].numpy()[:n] = windows[:, 1:]

    def _stored_records(self, indices: np.ndarray) -> list[np.ndarray]:
        """Views of these records' stored bytes in the mapped (or fetched) file."""
        record, local = np.divmod(indices, arrow_format.rows_per_batch(self.dataset, "records"))
        views = self.views
        return [views[r][1][views[r][0][i] : views[r][0][i + 1]] for r, i in zip(record, local, strict=True)]

    def _fill_records(self, slot: torch.Tensor, indices: np.ndarray) -> None:
        stored = self._stored_records(indices)
        record_ring.deliver_rows(self.records, slot.numpy(), stored)
        wanted = self.records.delivered_bytes
        rest = max((len(r) - wanted for r in stored), default=0)
        if rest > 0:  # the rest of each record read too (its pages touched), as the other backends read it
            scratch = np.empty(rest, np.uint8)
            for r in stored:
                scratch[: max(0, len(r) - wanted)] = r[wanted:]

    def _fill_images(self, slot_number: int, indices: np.ndarray, epoch: int, pool) -> list[tuple[int, str]]:
        slot = self._slot(slot_number)
        if self._records:
            self._fill_records(slot, indices)
            return []
        if self.form == "decoded":
            self._crops(slot.numpy(), indices, epoch, pool)
            return []
        return transforms.decode_batch(slot, indices, lambda k: self._encoded(int(indices[k])), self._decoder(),
                                       self.pipeline.augment, self.seed, epoch,
                                       reduced_scale=self.pipeline.jpeg_scale == "reduced", pool=pool,
                                       threads=self.settings.threads, damaged=self._check_record)

    def _crops(self, out: np.ndarray, indices: np.ndarray, epoch: int, pool) -> None:
        """A crop per sample, in `pool`'s threads: of whole frames (`crops.crop_frames`; by the crop workers
        instead where there are: `_by_workers`) or of centre squares (`crops.crop_batch`)."""
        record, local = np.divmod(indices, ROWS_PER_BATCH)
        views = self.views
        if self.stored_form == "frames":
            starts_of, dims_of = self._frame_table()
            starts, dims = starts_of[indices], dims_of[indices]
            crops.crop_frames(out, indices, [v[1] for v in views], record, starts, dims, self.pipeline.augment,
                              self.seed, epoch, pool, self.settings.threads)
            return
        size = self._square()
        crops.crop_batch(out, indices, views, record, local * (size * size * 3), size, self.pipeline.augment,
                         self.seed, epoch, pool, self.settings.threads)

    def _frame_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sample's frame: (start in its record batch's pixel data, (height, width, source height,
        source width)), indexed by sample: looked up a batch at a time, not sample by sample in Python."""
        if self._frames is None:
            views = self.views
            self._frames = (np.concatenate([view[0][:-1] for view in views]).astype(np.int64),
                            np.concatenate([view[2] for view in views]))
        return self._frames

    def _encoded(self, index: int) -> memoryview:
        """The stored JPEG bytes of sample `index`: a view of the mapped (or fetched) file."""
        record, local = divmod(index, ROWS_PER_BATCH)
        offsets, data = self.views[record]
        return memoryview(data[offsets[local] : offsets[local + 1]])

    def _check_record(self, index: int) -> None:
        """Raise when the record batch of a sample that failed to decode is damaged in the Arrow file:
        that is not the source's fault, so not a failure of the sample."""
        if self._conversion is not None:
            self._conversion.check("all", [index // ROWS_PER_BATCH])

    def _decoder(self) -> str:
        choice = self.settings.decoder
        return transforms.decoder_name("auto") if choice == "auto" else choice

    def is_open(self) -> bool:
        return self._views is not None

    def ring_batch(self, slot: int, indices: np.ndarray, failures: list[tuple[int, str]]) -> HostBatch:
        # Bytes read from the Arrow file: each sample's stored row: decoded pixels (more than the JPEGs
        # they came from, which goodput shows), or its stored JPEG (with restart markers: not the source's).
        read: int | None = None
        if self._records:  # each record whole
            return record_ring.record_batch(self._slot(slot), indices,
                                            sum(len(r) for r in self._stored_records(indices)))
        if self.stored_form in ("frames", "encoded", "reencoded"):  # the stored rows' own lengths
            views = self.views
            read = sum(int(views[r][0][i + 1] - views[r][0][i])
                       for r, i in zip(*np.divmod(indices, ROWS_PER_BATCH), strict=True))
        elif self.form == "decoded":
            read = len(indices) * self._square() ** 2 * 3
        return slot_batch(self._slot(slot), indices, failures, self.dataset.labels, self.layout, read)

    def fill_ring(self, batches, epoch: int, free: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
        if self._shadow is not None:
            self._producer_via_tier(batches, epoch, free, ready, stop)
            return
        if self.croppers is not None:
            self._by_workers(batches, epoch, free, ready, stop)
            return
        with ThreadPoolExecutor(self.settings.threads, thread_name_prefix="loadopt-arrow") as pool:
            for n, indices in enumerate(batches):
                slot = next_slot(free, stop)
                if slot is None:
                    return
                if self._tokens:
                    self._fill_tokens(self._slot(slot), indices)
                    failures: list[tuple[int, str]] = []
                else:
                    failures = self._fill_images(slot, indices, epoch, pool)
                if (self.form == "encoded" or self._records) and (n + 1) % TRIM_EVERY == 0:
                    self._release_mapped_jpegs()
                ready.put((slot, indices, failures))

    def _by_workers(self, batches, epoch: int, free: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
        """Each batch cropped (whole frames) or decoded (encoded JPEGs) by the worker processes, two batches in
        flight: they are sent batch n + 1 before batch n is collected, so each goes on to it the moment it is
        done (no idle gap while this thread hands a batch over). A sample that failed to decode is checked
        against its record batch here, as the threads' path does (`_check_record`: damage in the file raises).
        The encoded form's workers let go of the file's pages they mapped every `TRIM_EVERY` batches (see
        `_release_mapped_jpegs`)."""
        croppers = self.croppers
        assert croppers is not None, "fill_ring takes this path with workers only"
        augment, seed, frames = self.pipeline.augment, self.seed, self.stored_form == "frames"
        starts_of, sizes_of = self._frame_table() if frames else self._encoded_table()
        decoder, reduced = self._decoder(), self.pipeline.jpeg_scale == "reduced"
        in_flight: collections.deque[tuple[int, np.ndarray]] = collections.deque()

        def hand_over() -> None:
            failures = croppers.receive().failures
            slot, indices = in_flight.popleft()
            for index, _ in failures:
                self._check_record(index)
            ready.put((slot, indices, failures))

        try:
            for n, indices in enumerate(batches):
                slot = next_slot(free, stop)
                if slot is None:
                    return
                which, starts, sizes = indices // ROWS_PER_BATCH, starts_of[indices], sizes_of[indices]
                if frames:  # sizes: each frame's dims
                    croppers.send(slot, indices, which, starts, sizes, augment, seed, epoch)
                else:  # sizes: each JPEG's length
                    croppers.send_decode(slot, indices, which, starts, sizes, decoder, augment, seed, epoch, reduced,
                                         release=(n + 1) % TRIM_EVERY == 0)
                in_flight.append((slot, indices))
                if len(in_flight) > 1:
                    hand_over()
            while in_flight:
                hand_over()
        finally:
            croppers.drain()  # an epoch stopped early: its batches' replies must not meet the next one's

    def _encoded_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sample's JPEG: (start in its record batch's data, length), indexed by sample."""
        if self._jpegs is None:
            offsets = [view[0] for view in self.views]
            self._jpegs = (np.concatenate([o[:-1] for o in offsets]).astype(np.int64),
                           np.concatenate([np.diff(o) for o in offsets]).astype(np.int64))
        return self._jpegs

    def _release_mapped_jpegs(self) -> None:
        """Unmap the encoded form's pages read so far (madvise DONTNEED: they stay in the page cache; the next
        read of one is a minor fault). Each JPEG is read once an epoch, so the mapping gains nothing from
        keeping them, while every page touched counted in the process's memory (PSS) until the whole file
        was: x4.4 over an epoch of 1M small JPEGs (bench/scale.py). Not for the decoded forms, whose warm
        rate is a memory copy's and is read from pages kept mapped (a fault per page would cost it)."""
        for _, data in self.views:
            release_pages(data)

    def _producer_via_tier(self, batches, epoch: int, free: queue.Queue, ready: queue.Queue,
                           stop: threading.Event) -> None:
        """The producer on a tier: batch n+1's samples are fetched into the file's image while batch n is
        assembled from it, then batch n's pages are let go."""
        shadow = self._shadow
        assert shadow is not None, "fill_ring takes this path on a tier only"
        with ThreadPoolExecutor(self.settings.threads, thread_name_prefix="loadopt-arrow") as pool, \
                ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix="loadopt-arrow-io") as io, \
                ThreadPoolExecutor(1, thread_name_prefix="loadopt-arrow-fetch") as fetcher:
            ahead = fetcher.submit(shadow.fetch, batches[0], io) if batches else None
            for n, indices in enumerate(batches):
                if ahead is not None:  # batch n's samples, fetched while batch n-1 was assembled
                    ahead.result()
                ahead = fetcher.submit(shadow.fetch, batches[n + 1], io) if n + 1 < len(batches) else None
                slot = next_slot(free, stop)
                if slot is None:
                    return
                failures = self._fill_images(slot, indices, epoch, pool)
                shadow.drop(indices)
                ready.put((slot, indices, failures))

    def frame_sources(self) -> list[np.ndarray] | None:
        """The stored frames' (or JPEGs') bytes per record batch, mapped from the local file (not on a tier,
        whose file image is fetched into as batches go)."""
        if self.stored_form not in self.worker_forms or self._shadow is not None:
            return None
        return [view[1] for view in self.views]

    def close(self) -> None:
        self.stop_workers()  # they inherited the file's mapping
        self._shadow = None
        # the record batches keep the file mapped until they are dropped
        self._views = self._windows = self._conversion = None
        self._ring = None


def _windows_view(batches: list, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, starts, width): one zero-copy array of token ids over the whole mapped file, and where
    each window starts in it, so a batch is one gather, not one per record batch (a batch of 32 windows
    touches ~28 record batches of the default corpus)."""
    itemsize = np.dtype(dtype).itemsize
    columns = [b.column(b.num_columns - 1) for b in batches]
    width = columns[0].type.byte_width // itemsize
    addresses = [c.buffers()[1].address + c.offset * c.type.byte_width for c in columns]
    first = min(addresses)
    end = max(a + len(c) * c.type.byte_width for a, c in zip(addresses, columns, strict=True))
    # The record batches sit in one memory map; the buffer keeps them (and so the map) alive.
    tokens = np.frombuffer(pa.foreign_buffer(first, end - first, base=batches), dtype)
    if any((a - first) % itemsize for a in addresses):
        raise DatasetError("Arrow token windows are not aligned to their dtype (a corrupt file?)")
    starts = np.concatenate([(a - first) // itemsize + np.arange(len(c)) * width
                             for a, c in zip(addresses, columns, strict=True)])
    return tokens, starts.astype(np.int64), width
