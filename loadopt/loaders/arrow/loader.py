"""The `arrow` backend: samples stored once in memory-mapped Arrow IPC files (the conversion's shards).

Reading a sample costs a page-cache hit and a copy: no file opens, no per-sample Python objects.
A producer thread assembles each batch straight into a slot of a preallocated ring (pinned where
CUDA is there), `prefetch` batches ahead, with `threads` threads sharing each batch. The backend only
locates each sample's bytes in the mapped file (`ArrowColumn`); the stored form's filler fills:
- decoded pixels: whole frames (train): the JPEG paths' crop box scaled into stored pixels, resized
  and flipped (`crops.crop_frames`); centre squares (eval, or `frame: centre`): a crop copied from the
  mapped rows;
- encoded JPEGs: decoded in the threads (simplejpeg and torch's resize release the GIL) with the
  same pipeline as the `torch` backend, so both deliver equal tensors;
- token windows: one gather a batch over the whole mapped file into int64 inputs/targets;
- records (`dataset.kind: records`): the `records` form holds each record whole; its first `delivered_bytes`
  are copied into the slot's row and the rest read into a scratch buffer (every byte of a record is read
  from storage, as the `torch` and `posix` backends read it: the workload is the record's size).
Errors in the producer reach the consumer as exceptions (a bad sample by the `on_error` policy).

On a tier that is not plain local disk (emulated, or remote storage) the shards are not memory-mapped:
their image in anonymous memory (`tier_reads.ShadowShards`) gets each batch's samples fetched through the
tier (`io_threads` range requests in flight, the next batch's while this one is assembled), so the
tier's limits and counters see every byte, and the views and fills above run unchanged. Where the conversion
was written to its remote home, this machine holds only the shards' outlines: the images are made from them,
and only the samples' bytes are fetched.
"""

from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from loadopt.errors import DatasetError
from loadopt.loaders.arrow.column import ArrowColumn
from loadopt.loaders.fillers import EncodedJpegs, FillContext, Filled, WholeFrames
from loadopt.loaders.heap import TRIM_EVERY
from loadopt.loaders.ring import RingLoader, RingSettings, next_slot
from loadopt.loaders.serving import RequestPath, Unservable
from loadopt.storage.forms import placement, shard_work, tier_reads
from loadopt.storage.forms.arrow_convert import convert, open_conversion, reference_names
from loadopt.storage.forms.arrow_format import ArrowConversion, arrow_path, shard_files
from loadopt.storage.forms.arrow_outline import Outline
from loadopt.storage.forms.ready import make_ready, read_from
from loadopt.storage.sources.shards import shard_table
from loadopt.storage.tiers.pagecache import release_pages


class ArrowSettings(RingSettings):
    # form, decoded_size, frame, prefetch: RingSettings
    threads: int = Field(2, ge=1)  # threads sharing each batch: decode (encoded) or crop copies (decoded)
    decoder: Literal["auto", "pil", "simplejpeg"] = "auto"  # encoded form
    io_threads: int = Field(8, ge=1)  # range requests in flight on a tier that is not the local disk
    shard_mib: float = Field(shard_work.DEFAULT_SHARD_MIB, gt=0)  # shard file size of the conversion


class ArrowLoader(RingLoader[ArrowSettings]):
    name = "arrow"
    Settings = ArrowSettings
    worker_fillers = (WholeFrames, EncodedJpegs)  # the mapped file's JPEGs are decoded by workers too

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._column: ArrowColumn | None = None  # the opened file's samples (`prepare`)
        self._conversion: ArrowConversion | None = None  # the opened file's record batches and checksums
        self._shadow: tier_reads.ShadowShards | None = None  # on a tier: the shards' image, fetched through it

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

    def request_paths(self, max_batch: int) -> list[RequestPath]:
        """A fixed catalogue: the request carries a sample id, its image is read from this conversion."""
        from loadopt.loaders.arrow.serving import CatalogueRequests

        if self.dataset.kind != "images":
            raise Unservable(f"arrow serves image requests; this dataset holds {self.dataset.kind}")
        return [CatalogueRequests(f"arrow {self.stored_text()} catalogue", self.pipeline, self.seed, self)]

    def describe(self) -> str:
        s = self.settings
        return f"{self.stored_text()} threads={s.threads} prefetch={s.prefetch}" + \
            placement.via_tier(self.dataset, conversion=True)

    def fill_context(self) -> FillContext:
        return replace(super().fill_context(), damaged=self._check_record)

    # -- the file ------------------------------------------------------------------------------

    def prepare(self, progress=None, convert_missing: bool = True) -> None:
        self.stop_workers()  # they inherited the views this replaces
        shard_mib = self.settings.shard_mib
        path = arrow_path(self.dataset, self.stored_form, self.size, shard_mib)
        make_ready(self.dataset, path, reference_names,
                   (lambda: convert(self.dataset, self.stored_form, self.size, shard_mib, progress=progress,
                                    on_error=self.on_error)) if convert_missing else None,
                   "arrow", self.form, " --decoded" if self.size else "")
        conversion = open_conversion(self.dataset, self.stored_form, self.size, shard_mib,
                                     placement.conversion_tier(self.dataset), self.settings.io_threads)
        self.unreadable, self._conversion = conversion.skipped, conversion  # samples the conversion skipped
        batches: list[pa.RecordBatch] = conversion
        if isinstance(conversion.images, tier_reads.ShadowShards):  # the data on the remote home, outlines here
            self._shadow = conversion.images
        elif (home := read_from(self.dataset, path)).tier is not None:  # every byte through the tier
            self._shadow = tier_reads.ShadowShards(home.tier, home.paths([f.name for f in conversion.files]),
                                                   [Outline.of(f) for f in conversion.files], self.settings.io_threads)
            batches = self._shadow.record_batches()
        runs = shard_table(self.dataset, self.pipeline.shard_samples).bounds  # what the window shuffle deals
        mapped = self._shadow is None  # the batches are the shard files' mappings: offsets read with pread
        self._column = ArrowColumn(batches, conversion.batch_file.copy(), runs, conversion.files if mapped else None,
                                   conversion.offsets_at if mapped else None)

    def storage_files(self) -> list[str]:
        if placement.remote_home(self.dataset) is not None:
            return []  # read from the dataset's storage: no local page cache to evict
        path = arrow_path(self.dataset, self.stored_form, self.size, self.settings.shard_mib)
        try:
            return [str(f) for f in shard_files(path, shard_work.read_manifest(path, "Arrow conversion"))]
        except DatasetError:  # not converted yet: nothing of it in the page cache
            return []

    @property
    def column(self) -> ArrowColumn:
        """The opened file's samples (`ArrowColumn`); `prepare` opens it."""
        assert self._column is not None, "prepare() opens the Arrow file"
        return self._column

    def _check_record(self, index: int) -> None:
        """Raise when the record batch of a sample that failed to decode is damaged in the Arrow file:
        that is not the source's fault, so not a failure of the sample."""
        if self._conversion is not None:
            self._conversion.check("all", [self._conversion.batch_of(index)])

    def is_open(self) -> bool:
        return self._column is not None

    # -- batches -------------------------------------------------------------------------------

    def _fill(self, slot: int, indices: np.ndarray, epoch: int, pool: Executor) -> Filled:
        assert self._ring is not None, "produce() makes the ring before the producer fills it"
        return self.filler.fill(self._ring[slot], indices, self.column.locate(indices), epoch, pool)

    def fill_ring(self, batches, epoch: int, free: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
        self.column.forget()  # the last epoch's runs: this one deals others
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
                filled = self._fill(slot, indices, epoch, pool)
                if self.filler.release_mapped and (n + 1) % TRIM_EVERY == 0:
                    self._release_mapped()
                ready.put((slot, *filled))

    def _by_workers(self, batches, epoch: int, free: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
        """Each batch cropped (whole frames) or decoded (encoded JPEGs) by the worker processes, two batches in
        flight: they are sent batch n + 1 before batch n is collected, so each goes on to it the moment it is
        done (no idle gap while this thread hands a batch over). A sample that failed to decode is checked
        against its record batch here, as the threads' path does (`_check_record`: damage in the file raises).
        The encoded form's workers let go of the file's pages they mapped every `TRIM_EVERY` batches (see
        `_release_mapped`)."""
        croppers = self.croppers
        assert croppers is not None, "fill_ring takes this path with workers only"
        filler = self.filler
        in_flight: collections.deque[tuple[int, np.ndarray, int]] = collections.deque()

        def hand_over() -> None:
            failures = croppers.receive().failures
            slot, indices, nbytes = in_flight.popleft()
            for index, _ in failures:
                self._check_record(index)
            ready.put((slot, indices, failures, nbytes))

        try:
            for n, indices in enumerate(batches):
                slot = next_slot(free, stop)
                if slot is None:
                    return
                located = self.column.locate(indices)
                filler.send(croppers, slot, indices, located, epoch,
                            release=filler.release_mapped and (n + 1) % TRIM_EVERY == 0)
                in_flight.append((slot, indices, located.nbytes))
                if len(in_flight) > 1:
                    hand_over()
            while in_flight:
                hand_over()
        finally:
            croppers.drain()  # an epoch stopped early: its batches' replies must not meet the next one's

    def _release_mapped(self) -> None:
        """Unmap the pages of the samples read so far (madvise DONTNEED: they stay in the page cache; the next
        read of one is a minor fault), for a form whose samples are read once an epoch (`release_mapped`: the
        encoded JPEGs, records): the mapping gains nothing from keeping them, while every page touched counted
        in the process's memory (PSS) until the whole file was: x4.4 over an epoch of 1M small JPEGs
        (benchmarks/scale.py). Not for the decoded forms, whose warm rate is a memory copy's and is read from pages
        kept mapped (a fault per page would cost it)."""
        for data in self.column.sources:
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
                filled = self._fill(slot, indices, epoch, pool)
                shadow.drop(indices)
                ready.put((slot, *filled))

    def frame_sources(self) -> list[np.ndarray] | None:
        """The stored frames' (or JPEGs') bytes per record batch, mapped from the local file (not on a tier,
        whose file image is fetched into as batches go)."""
        if not issubclass(self.filler_class, self.worker_fillers) or self._shadow is not None:
            return None
        return list(self.column.sources)

    def close(self) -> None:
        self.stop_workers()  # they inherited the file's mapping
        self._shadow = None
        # the record batches keep the file mapped until they are dropped
        self._column = self._conversion = None
        self._ring = None
