"""The `posix` backend: raw shards read with `os.preadv` into a preallocated, aligned staging buffer.

Per batch, the samples' byte ranges are sorted by (shard, offset), adjacent ones coalesced into runs
(samples sit at 4 KiB boundaries, so neighbours in a shard are one read), the runs split into tasks
of at most `task_kib` and read by `io_threads` threads straight into the staging buffer. With
`o_direct` the shards are opened O_DIRECT (every offset, length and the buffer are 4 KiB aligned),
bypassing the page cache. The reads of the next `read_ahead` batches are in flight while batch n is
finished into its ring slot (pinned where CUDA is there) by the stored form's filler from
the staging buffer (`fillers.Located`):
- decoded pixels: whole frames (train) cropped, resized and flipped by the JPEG paths' plan
  (`crops.crop_frames`); centre squares (eval, `frame: centre`): the crop copied, one copy;
- encoded JPEGs: decoded in threads with the pipeline of the `torch` and `arrow` backends;
- token windows: one gather into int64 inputs and targets;
- records (`dataset.kind: records`): the raw shards' `records` form holds each record whole, read by its
  byte range like any sample (O_DIRECT too: 4 KiB aligned), its first `delivered_bytes` copied into the
  slot's row (`fillers.Records`).
Decoded centre squares through the page cache (no O_DIRECT) take another path where the native module is
built: one read per sample's crop rows into a buffer that stays in cache, then the crop
(`PageCacheCrops`). Batches are the `arrow` backend's, bit for bit (same decoded pixels, same plan).
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from loadopt.loaders import crops
from loadopt.loaders.crop_processes import fork_available
from loadopt.loaders.fillers import EncodedJpegs, Located
from loadopt.loaders.posix import cache as posix_cache
from loadopt.loaders.ring import RingLoader, RingSettings, next_slot, shared_empty
from loadopt.loaders.shard_reader import PosixReader, ShardReader, aligned_empty
from loadopt.machine import usable_cores
from loadopt.storage.forms import placement, raw_convert, raw_format, tier_reads
from loadopt.storage.forms.raw_format import ALIGN, RawIndex, align_up
from loadopt.storage.forms.ready import make_ready, read_from


class PosixSettings(RingSettings):
    # form, decoded_size, frame, prefetch: RingSettings
    shard_mib: float = Field(raw_format.DEFAULT_SHARD_MIB, gt=0)  # shard file size of the conversion
    o_direct: bool = False  # bypass the page cache (needs a filesystem that allows O_DIRECT: not tmpfs)
    # preadv calls in flight: one per usable core (a page-cache read is a copy on a core), 2 to 8 (8: the
    # best cold O_DIRECT rate measured; the tuner tries 2 and 8).
    io_threads: int = Field(default_factory=lambda: min(8, max(2, usable_cores())), ge=1)
    task_kib: int = Field(4096, ge=4)  # the largest single read; longer runs are split for parallelism
    threads: int = Field(2, ge=1)  # threads finishing each batch: crop copies (decoded) or decode (encoded)
    read_ahead: int = Field(2, ge=1)  # batches whose reads are in flight while one is finished
    # Decoded, through the page cache: when a batch misses it and the shards fit in half the free memory,
    # read them all in sequentially first (see `posix_cache.prefill`).
    prefill: bool = True
    decoder: Literal["auto", "pil", "simplejpeg"] = "auto"  # encoded form


# `loadopt convert`'s flags for a stored form (the message of a missing conversion)
CONVERT_FLAGS = {"decoded": " --decoded", "frames": " --decoded", "reencoded": " --frame whole"}


class PosixLoader(RingLoader[PosixSettings]):
    name = "posix"
    Settings = PosixSettings
    reader_class: type = PosixReader  # a device backend swaps its reader in; tests swap it back
    # Through the page cache, the fillers' `page_cache_path`: centre squares per sample
    # (`posix_cache.PageCacheCrops`), whole frames from the mappings when cached (`_MappedCrops`).
    sample_reads = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # With the job's own transform, the encoded form's JPEGs are decoded (and transformed) by the crop worker
        # processes from staging buffers in shared memory (threads of one process take turns at a Python transform).
        self._shared_staging: list[np.ndarray] | None = None
        self._raw: RawIndex | None = None
        self._reader: ShardReader | None = None
        self._maps: list[mmap.mmap | bytes] | None = None
        # mincore over a batch's frames costs the producer a page cache lookup per page (the parent never
        # maps them), a large share of the crop workers' time for it. It checks until a batch was
        # cropped without a major fault, then the workers' major faults say when pages were missing (kept
        # from epoch to epoch; checked again from the start when the shards are mapped again).
        self._check_frames = True

    @property
    def raw(self) -> RawIndex:
        """The opened conversion (its index, meta and shard paths); prepares the loader when needed."""
        if self._raw is None:
            self.prepare(convert_missing=False)
        assert self._raw is not None  # prepare opened it
        return self._raw

    @property
    def reader(self) -> ShardReader:
        """What reads the shards (`reader_class`: a descriptor per shard, or the tier's reader); prepares
        the loader when needed."""
        if self._reader is None:
            self.prepare(convert_missing=False)
        assert self._reader is not None  # prepare opened it
        return self._reader

    def set_check_frames(self, check: bool) -> None:
        """Whether the next batches' frames are checked for residency (mincore) before being cropped from
        the mappings: only after a batch whose crops met major faults."""
        self._check_frames = check

    def mapped_shards(self) -> list[mmap.mmap | bytes]:
        """Read-only mappings of the shards (b"" for an empty one) for the per-sample crops through the
        page cache (`posix_cache`): mapped on first use, held until `close()` (mapping them again
        every epoch costs a page fault per 16 pages, and the unmapping). Mapped pages cannot be evicted: evict the
        shards before the first epoch or after `close()`."""
        if self._maps is None:
            reader = self.reader
            fds = reader.fds if isinstance(reader, PosixReader) else []
            self._maps = [mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if os.fstat(fd).st_size else b"" for fd in fds]
        return self._maps

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list]:
        # o_direct is left out: it changes what a warm bench measures (a list in the config adds it).
        return {"form": ["decoded", "encoded"], "threads": [n for n in (1, 2, 4, 8, 16, 32) if n < cores] + [cores],
                "io_threads": sorted({2, min(8, max(2, cores)), 8}), "read_ahead": [1, 2]}

    @classmethod
    def cpu_demand(cls, settings: PosixSettings) -> int:
        # The finishing threads; io threads spend their time blocked in preadv (a count of reads in flight).
        return settings.threads

    def reads_conversion(self) -> bool:
        return True

    def describe(self) -> str:
        s = self.settings
        return f"{self.stored_text()} o_direct={s.o_direct} io_threads={s.io_threads} threads={s.threads}" + \
            placement.via_tier(self.dataset, conversion=True)

    def prepare(self, progress=None, convert_missing: bool = True) -> None:
        path = raw_format.raw_path(self.dataset, self.stored_form, self.size, self.settings.shard_mib)
        def convert() -> None:
            raw_convert.convert(self.dataset, self.stored_form, self.size, self.settings.shard_mib, progress=progress,
                                on_error=self.on_error)

        make_ready(self.dataset, path, raw_convert.reference_names, convert if convert_missing else None, "raw",
                   self.form, CONVERT_FLAGS.get(self.stored_form, ""))
        self._raw = raw_convert.open_conversion(self.dataset, self.stored_form, self.size, self.settings.shard_mib)
        raw = self._raw
        self.unreadable = {**self.skipped_at_open(),  # and those skipped in the conversion
                           **{int(i): str(why) for i, why in raw.meta.get("skipped", [])}}
        self.close_maps()
        if self._reader is not None:
            self._reader.close()
        home = read_from(self.dataset, path)
        if home.tier is None:
            self._reader = self.reader_class(raw.shards, self.settings.o_direct)
        else:  # every read through the tier (its limits, faults, counters); o_direct does not apply there
            self._reader = tier_reads.TierReader(home.tier, home.paths([shard.name for shard in raw.shards]))

    # -- reading -------------------------------------------------------------------------------

    def plan(self, indices: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int, int]], int]:
        """Where each sample of the batch lands in the staging buffer, and the read tasks
        (shard, file offset, staging offset, nbytes) covering them; also the bytes to read."""
        shard, offset, length = self.raw.locate(indices)
        padded = align_up(length)
        order = np.lexsort((offset, shard))
        starts = np.zeros(len(indices), np.int64)
        starts[order] = np.concatenate([[0], np.cumsum(padded[order])[:-1]])
        # A new run wherever the next sample in (shard, offset) order is not the file's next aligned block.
        s, o, p = shard[order], offset[order], padded[order]
        breaks = np.nonzero((s[1:] != s[:-1]) | (o[1:] != o[:-1] + p[:-1]))[0] + 1
        task = self.settings.task_kib * 1024 // ALIGN * ALIGN
        tasks = []
        for first, last in zip(np.r_[0, breaks], np.r_[breaks, len(order)], strict=True):
            run_offset, run_start = int(o[first]), int(starts[order[first]])
            run_bytes = int(o[last - 1] + p[last - 1]) - run_offset
            for at in range(0, run_bytes, task):
                tasks.append((int(s[first]), run_offset + at, run_start + at, min(task, run_bytes - at)))
        return starts, tasks, int(padded.sum())

    def _new_staging(self, nbytes: int):
        return aligned_empty(nbytes)

    def _submit(self, staging, tasks, io: ThreadPoolExecutor) -> list[Future]:
        """One future per io thread, each reading its share of the tasks one after another: as many
        reads in flight as a future per task gives (the cold case), without a pool hand-off per
        sample (which costs more than the read itself on a warm cache)."""
        read = self.reader.read

        def run(share: list[tuple[int, int, int, int]]) -> None:
            for shard, offset, at, nbytes in share:
                read(shard, offset, staging[at : at + nbytes])

        shares = [tasks[i :: self.settings.io_threads] for i in range(min(self.settings.io_threads, len(tasks)))]
        return [io.submit(run, share) for share in shares]

    # -- batches -------------------------------------------------------------------------------

    def _staged(self, staging, starts: np.ndarray, indices: np.ndarray, nbytes: int) -> Located:
        """The batch's bytes read into `staging` at `starts` (`plan`)."""
        raw = self.raw
        return Located([staging], np.zeros(len(indices), np.int32), starts, raw.locate(indices)[2], nbytes,
                       raw.frames_of(indices) if raw.meta["form"] == "frames" else None)

    def through_page_cache(self) -> bool:
        """Whether batches may be cropped from the shards' mappings (the filler's `page_cache_path`): the
        reads go through the page cache, into this process, with the native module there, and no job's own transform
        follows the crop (the staged batches' filler runs it)."""
        return self.sample_reads and not self.settings.o_direct and crops.native is not None and \
            isinstance(self.reader, PosixReader) and self.sample_transform is None

    def storage_files(self) -> list[str]:
        if self._raw is None:
            self.prepare(convert_missing=False)
        if placement.remote_home(self.dataset) is not None:
            return []  # read from the dataset's storage: no local page cache to evict
        return [str(shard) for shard in self.raw.shards]

    def is_open(self) -> bool:
        return self._raw is not None

    def fill_ring(self, batches, epoch: int, free: queue.Queue, ready: queue.Queue, stop: threading.Event) -> None:
        """`read_ahead` + 1 staging buffers: the reads of the next `read_ahead` batches are in flight
        while this one is finished (a batch's slot is refilled only after it was finished)."""
        raw, ring, filler = self.raw, self._ring, self.filler
        assert ring is not None  # produce made it
        cached = filler.page_cache_path if self.through_page_cache() else "staged"
        if cached == "per sample":
            self._page_cache_crops().produce(ring, batches, epoch, free, ready, stop)
            return
        most = int(align_up(raw.max_length)) * self.pipeline.batch_size
        depth = self.settings.read_ahead
        by_workers = self.croppers is not None and self._shared_staging is not None and self.decodes_in_workers()
        staging = self._shared_staging if by_workers else [self._new_staging(most) for _ in range(depth + 1)]
        assert staging is not None
        in_flight: collections.deque[tuple[int, np.ndarray, int]] = collections.deque()  # sent to the workers
        pending: dict[int, tuple] = {}
        # Whole frames through the page cache: a batch whose frames are all cached is cropped from the
        # shards' mappings (no staging copy of whole frames: the crop reads only its box).
        maps = [np.frombuffer(m, np.uint8) for m in self.mapped_shards()] if cached == "mapped batches" else None
        mapped_crops = _MappedCrops(self, ring, maps, self.croppers if maps is not None else None, epoch, ready)
        try:
            with ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix=f"loadopt-{self.name}-io") as io, \
                    ThreadPoolExecutor(self.settings.threads, thread_name_prefix=f"loadopt-{self.name}") as pool, \
                    ThreadPoolExecutor(1, thread_name_prefix=f"loadopt-{self.name}-crop") as finisher:
                for n, indices in enumerate(batches):
                    for ahead in range(n, min(n + depth + 1, len(batches))):
                        if ahead not in pending:
                            pending[ahead] = self._start(batches[ahead], staging[ahead % len(staging)], io, maps,
                                                         self._check_frames or mapped_crops.croppers is None)
                    starts, nbytes, reads, shards = pending.pop(n)
                    mapped = shards is not None and maps is not None
                    planned = crops.frame_boxes(indices, raw.frames_of(indices), self.pipeline.augment, self.seed,
                                                epoch) if mapped else None
                    mapped_crops.collect(1 if mapped and mapped_crops.croppers is not None else 0)
                    for read in reads:
                        read.result()
                    slot = next_slot(free, stop)
                    if slot is None:
                        return
                    if mapped:
                        mapped_crops.start(slot, indices, shards, starts, nbytes, planned, finisher, pool)
                        continue
                    if by_workers:  # decoded by the workers from the shared staging buffer; its reads are done
                        self._decode_by_workers(slot, indices, staging, n % len(staging), starts, nbytes, epoch,
                                                in_flight, ready)
                        continue
                    filled = filler.fill(ring[slot], indices, self._staged(staging[n % len(staging)], starts, indices,
                                                                           nbytes), epoch, pool)
                    ready.put((slot, *filled))
                mapped_crops.collect(0)
                while in_flight:
                    self._hand_over(in_flight, ready)
        finally:
            workers = mapped_crops.croppers or (self.croppers if by_workers else None)
            if workers is not None:  # an epoch stopped early: its batches' replies must not meet the next
                workers.drain()

    def _decode_by_workers(self, slot: int, indices: np.ndarray, staging: list[np.ndarray], which: int,
                           starts: np.ndarray, nbytes: int, epoch: int,
                           in_flight: collections.deque[tuple[int, np.ndarray, int]], ready: queue.Queue) -> None:
        """Batch `indices`, read into `staging[which]`, sent to the crop workers to decode and transform into ring
        slot `slot`; the batch before it then handed over. Two in flight, as arrow's: a worker done with its share
        of one goes on to the next (the shares of a batch end apart: a transform's cost varies by sample), and the
        staging has a buffer more than the reads ahead, so none is read into while the workers decode it."""
        croppers = self.croppers
        assert croppers is not None, "only where the workers run"
        lengths = self.raw.locate(indices)[2]
        located = Located(staging, np.full(len(indices), which, np.int32), starts, lengths, nbytes)
        self.filler.send(croppers, slot, indices, located, epoch, release=False)
        in_flight.append((slot, indices, nbytes))
        if len(in_flight) > 1:
            self._hand_over(in_flight, ready)

    def _hand_over(self, in_flight: collections.deque[tuple[int, np.ndarray, int]], ready: queue.Queue) -> None:
        """The oldest batch sent to the workers, once they are done with it, to the consumer."""
        assert self.croppers is not None, "only where the workers run"
        failures = self.croppers.receive().failures
        slot, indices, nbytes = in_flight.popleft()
        ready.put((slot, indices, failures, nbytes))

    def _start(self, indices: np.ndarray, staging: np.ndarray, io: ThreadPoolExecutor,
               maps: list[np.ndarray] | None = None,
               check: bool = True) -> tuple[np.ndarray, int, list[Future], np.ndarray | None]:
        """(starts, bytes, reads in flight, shards): the samples' places in `staging` once `reads` are
        done; or, where `maps` are given and every sample is cached (`check` False: taken to be, the
        shards' sizes still checked), their offsets in their `shards`' mappings (nothing read)."""
        if maps is not None:
            located, offsets, lengths = self.raw.locate(indices)
            shards = located.astype(np.int32)
            try:
                if check:
                    cached = crops.native.uncached(maps, shards, offsets, lengths) == 0
                else:  # a shard truncated since it was mapped would be a SIGBUS in a crop: its size, each batch
                    reader = self.reader
                    assert isinstance(reader, PosixReader), "shards are mapped only from their own files"
                    sizes = np.array([os.fstat(fd).st_size for fd in reader.fds], np.int64)
                    cached = bool((offsets + lengths <= sizes[shards]).all())
            except IndexError:  # a shard shorter than the index says: the staged read names it
                cached = False
            if cached:
                return offsets, int(align_up(lengths).sum()), [], shards
        starts, tasks, nbytes = self.plan(indices)
        return starts, nbytes, self._submit(staging, tasks, io), None

    def frame_sources(self) -> list[np.ndarray] | None:
        """The shards' mappings, where whole frames are cropped from the page cache (see `fill_ring`); the shared
        staging buffers, where the workers decode the encoded form for the job's transform."""
        if self.decodes_in_workers():
            if self._shared_staging is None:
                most = int(align_up(self.raw.max_length)) * self.pipeline.batch_size
                # one buffer more than the reads ahead: the batch the workers still decode keeps its own
                self._shared_staging = [shared_empty((most,), torch.uint8).numpy()
                                        for _ in range(self.settings.read_ahead + 2)]
            return self._shared_staging
        if self.through_page_cache():
            return [np.frombuffer(m, np.uint8) for m in self.mapped_shards()]
        return None

    def decodes_in_workers(self) -> bool:
        """Whether the crop worker processes decode the encoded form's JPEGs (and run the job's transform, if any), as
        `crop_in: processes` asks: out of the training process, whose own threads would compete with the loop that
        takes the batches (in a tight loop on 2 cores, threads delivered about a tenth less); `crop_in: threads`
        decodes in this process's threads (`fill_ring`)."""
        return issubclass(self.filler_class, EncodedJpegs) and \
            self.settings.crop_in == "processes" and self.device.type != "cuda" and fork_available() and \
            placement.conversion_tier(self.dataset) is None

    def crops_in_processes(self) -> bool:
        return self.decodes_in_workers() or super().crops_in_processes()

    def _page_cache_crops(self) -> posix_cache.PageCacheCrops:
        """The centre squares' producer through the page cache (`posix_cache`), over the mapped shards."""
        reader, s = self._reader, self.settings
        assert isinstance(reader, PosixReader) and self.size is not None, "through the page cache: centre squares"
        return posix_cache.PageCacheCrops(self.raw, reader, self.mapped_shards(), lambda indices: self.plan(indices)[1],
                                          self.size, self.pipeline.image_size, self.pipeline.augment, self.seed,
                                          s.threads, s.read_ahead, s.prefill)

    def close_maps(self) -> None:
        """Unmap the shards (`mapped_shards`) and close the crop workers that inherited them; the next
        epoch maps them again."""
        self.stop_workers()
        self._shared_staging = None  # the workers' staging goes with them (made again with the next)
        self._check_frames = True
        for mapping in self._maps or []:
            if isinstance(mapping, mmap.mmap):
                with contextlib.suppress(BufferError):  # a view still alive (in a traceback): unmapped when it goes
                    mapping.close()
        self._maps = None

    def close(self) -> None:
        self.close_maps()
        if self._reader is not None:
            self._reader.close()
        self._reader, self._raw, self._ring = None, None, None


class _MappedCrops:
    """The batches cropped straight from the shards' mappings, oldest first: (slot, indices, bytes, future),
    the future None for the crop workers'. A batch goes to the crop threads (`finisher`) while the producer
    draws the next one's crop plan; the crop workers are sent batch n + 1 before batch n is collected, so
    each goes on to it the moment it is done, with no idle gap while the producer hands a batch over."""

    def __init__(self, loader: PosixLoader, ring: list[torch.Tensor], maps: list[np.ndarray] | None, croppers,
                 epoch: int, ready: queue.Queue) -> None:
        self.loader, self.ring, self.maps, self.croppers, self.epoch, self.ready = \
            loader, ring, maps, croppers, epoch, ready
        self.cropping: collections.deque[tuple[int, np.ndarray, int, Future | None]] = collections.deque()

    def start(self, slot: int, indices: np.ndarray, shards, starts, nbytes: int, planned,
              finisher: ThreadPoolExecutor, pool: ThreadPoolExecutor) -> None:
        loader = self.loader
        frames = loader.raw.frames_of(indices)
        augment, seed = loader.pipeline.augment, loader.seed
        if self.croppers is not None:
            self.croppers.send(slot, indices, shards, starts, frames, augment, seed, self.epoch, planned)
            self.cropping.append((slot, indices, nbytes, None))
            return
        assert self.maps is not None, "mapped batches only where the shards are mapped"
        self.cropping.append((slot, indices, nbytes, finisher.submit(
            crops.crop_frames, self.ring[slot].numpy(), indices, self.maps, shards, starts, frames, augment, seed,
            self.epoch, pool, loader.settings.threads, planned=planned)))

    def collect(self, keep: int) -> None:
        """Hand all but `keep` of the batches being cropped to the consumer."""
        while len(self.cropping) > keep:
            done_slot, done_indices, done_bytes, future = self.cropping.popleft()
            if future is None:
                assert self.croppers is not None, "only the crop workers' batches have no future"
                faults = self.croppers.receive().major_faults
            else:
                faults = future.result()
            self.loader.set_check_frames(bool(faults))  # major faults (crop workers) or None (threads)
            self.ready.put((done_slot, done_indices, [], done_bytes))
