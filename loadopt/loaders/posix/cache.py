"""Part of the `posix` backend: its decoded samples read through the page cache, in C.

The centre squares' producer of the posix backend where it reads through the page cache (`PageCacheCrops`).
The shards are mapped read-only (`PosixLoader.mapped_shards`); a batch is cropped by one native call
(`_native.read_crops`: `threads` threads in C, no Python per sample, the GIL released throughout).
A sample whose crop rows are all in the page cache (mincore) is cropped straight from the mapping
into the batch slot: one copy, as the `arrow` backend's. Profiled: a pread of the rows into a
scratch buffer first (the kernel's copy) took as long as the crop copy itself, half the rate. A
sample that is not cached is read with one pread of its rows into a scratch buffer that stays in
the core's cache, then cropped from there, and counted as a miss. Once a batch was all cached, the next
ones are cropped without mincore (a system call a sample, a cost the warm rate shows) and a sample not
cached is read in by its page fault, the threads' major faults counted as the misses; any miss turns the
per-sample check back on for the next batch. Staging whole batches instead (the
O_DIRECT path) sends every byte through memory twice more, far below the memory copy rate warm.
(Linux's mincore tells the page cache's state only for files the process owns or may write, as the
conversions in the user's own cache are; for others it says "cached", and misses are then page faults
that read around the sample, as the `arrow` backend's, and are not counted.)
The mappings are held until the loader is closed: mapping them again every epoch costs a page fault per
16 pages, and the unmapping. Mapped pages cannot be evicted, so a
cold run evicts before the first epoch or after `close()` (as the bench does).

When a batch misses the cache:
- shards that fit in half the free memory are read in sequentially first (`prefill`): the disk's
  sequential rate, and the kernel fills the cache with large folios (each later read of a sample
  cheaper than from the 4 KiB pages that random reads or WILLNEED leave behind);
- otherwise the samples of the next `read_ahead` batches are announced to the kernel
  (POSIX_FADV_WILLNEED: read asynchronously, many requests deep). Announcing every batch, hit or
  miss, would cost the warm rate dearly (the kernel walks every page of every sample).
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import psutil

from loadopt.errors import DatasetError
from loadopt.loaders import crops
from loadopt.loaders.ring import next_slot
from loadopt.loaders.shard_reader import PosixReader
from loadopt.loaders.transforms import Augment
from loadopt.storage.forms.raw_format import RawIndex
from loadopt.storage.tiers.sequential import read_sequential

# A batch's read tasks: (shard, file offset, staging offset, nbytes) each (`PosixLoader.plan`)
ReadTasks = list[tuple[int, int, int, int]]

PREFILL_BLOCK = 8 << 20  # sequential reads this large make the kernel's readahead use large folios


def fits_in_memory(shards: list) -> bool:
    """Whether the shards take at most half of the memory available now."""
    return sum(os.path.getsize(shard) for shard in shards) <= psutil.virtual_memory().available // 2


def advise(crops_: PageCacheCrops, indices: np.ndarray) -> None:
    """POSIX_FADV_WILLNEED over the runs of these samples (a no-op for pages already cached)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for shard, offset, _, nbytes in crops_.tasks(indices):
        os.posix_fadvise(crops_.reader.fds[shard], offset, nbytes, os.POSIX_FADV_WILLNEED)


def all_cached(fds: list[int], places: list[tuple[int, int]], nbytes: int) -> bool:
    """Whether `nbytes` at each (shard, offset) are in the page cache: RWF_NOWAIT reads (True where
    the kernel cannot tell)."""
    flag = getattr(os, "RWF_NOWAIT", 0)
    if not flag:
        return True
    buffer = [np.empty(nbytes, np.uint8).data]  # its memoryview
    try:
        return all(os.preadv(fds[shard], buffer, offset, flag) == nbytes for shard, offset in places)
    except BlockingIOError:
        return False
    except OSError:  # e.g. EOPNOTSUPP: the reads will tell (or not) as they go
        return True


def prefill(shards: list) -> None:
    """Read every shard front to back in large blocks, into the page cache (the data is dropped).
    Through descriptors of its own: the kernel keeps readahead state per open file, and the
    samples' reads on the loader's descriptors would break the sequential stream (then fewer
    large folios)."""
    read_sequential([str(shard) for shard in shards], PREFILL_BLOCK)


@dataclass
class PageCacheCrops:
    """The producer of the posix backend for centre squares without O_DIRECT: each batch read and cropped
    from the shards' mappings (`maps`, through `reader`'s descriptors) by one native call, `size` px crops of
    `stored` px squares; a miss prefills the shards (`prefill`: where they fit in memory) or announces the
    next `read_ahead` batches (`advise`, over the read `tasks` of a batch)."""

    raw: RawIndex
    reader: PosixReader
    maps: list[mmap.mmap | bytes]
    tasks: Callable[[np.ndarray], ReadTasks]
    stored: int
    size: int
    augment: Augment
    seed: int
    threads: int
    read_ahead: int
    prefill: bool

    def produce(self, ring: list, batches: Sequence[np.ndarray], epoch: int, free: queue.Queue, ready: queue.Queue,
                stop: threading.Event) -> None:
        """Fill free slots of `ring` with `batches` in order; put `(slot, indices, failures, bytes read)` on
        `ready`."""
        raw, reader, stored, size = self.raw, self.reader, self.stored, self.size
        span = (size - 1) * stored * 3 + size * 3  # from a crop's first pixel to past its last
        fd_array, mapped = np.asarray(reader.fds, np.int32), np.array([len(m) for m in self.maps], np.int64)
        advised = 0
        # mincore each sample (`check`) until a batch is all cached, and again after any miss; in between the
        # crops read the mappings unchecked and a miss shows as a major fault (a system call a sample costs rate)
        check = True
        prefill_allowed = self.prefill and fits_in_memory(raw.shards)
        if prefill_allowed and batches:
            # Before any sample is read: samples read at random first break the kernel's sequential
            # readahead at every one of them, and the prefill then leaves mostly small folios.
            first_shards, first_offsets, _ = raw.locate(batches[0][:8])
            if not all_cached(reader.fds, list(zip(first_shards.tolist(), first_offsets.tolist(), strict=True)),
                              span):
                prefill(raw.shards)
                prefill_allowed = False
        for n, indices in enumerate(batches):
            slot = next_slot(free, stop)
            if slot is None:
                return
            tops, lefts, flips = crops.plan_crops(indices, stored - size, self.augment, self.seed, epoch)
            located, stored_at, _ = raw.locate(indices)
            shards = located.astype(np.int32)
            offsets = crops.crop_offsets(stored_at, tops, lefts, stored)
            self._check_ends(shards, offsets, span, mapped)
            # One call a batch: `threads` threads in C, the GIL released (Python worker threads handing the GIL
            # back and forth at every chunk cost rate).
            misses, failed, _ = crops.native.read_crops(ring[slot].numpy(), self.maps, fd_array, shards, offsets,
                                                        flips.astype(np.uint8), stored * 3, size, 0, len(indices),
                                                        self.threads, check)
            check = misses > 0
            if failed >= 0:  # read again here for the one-line error that names the shard
                reader.read(int(shards[failed]), int(offsets[failed]), np.empty(span, np.uint8))
                raise DatasetError(f"{raw.shards[shards[failed]]}: cannot read the sample at byte {offsets[failed]}")
            if misses and prefill_allowed:
                prefill(raw.shards)
                prefill_allowed = False  # once an epoch: a later miss means the cache cannot hold them
            elif misses:
                for ahead in range(max(advised, n + 1), min(n + self.read_ahead + 1, len(batches))):
                    advise(self, batches[ahead])
                advised = max(advised, n + self.read_ahead + 1)
            ready.put((slot, indices, [], span * len(indices)))

    def _check_ends(self, shards: np.ndarray, offsets: np.ndarray, span: int, mapped: np.ndarray) -> None:
        """Name a shard truncated since it was mapped (a crop past its end would be SIGBUS unchecked)."""
        ends = np.minimum(mapped, [os.fstat(fd).st_size for fd in self.reader.fds])
        short = np.nonzero(offsets + span > ends[shards])[0]
        if len(short):
            k = int(short[0])
            raise DatasetError(f"{self.raw.shards[shards[k]]}: ends at byte {ends[shards[k]]}, the index needs "
                               f"{offsets[k] + span} (truncated shard)")
