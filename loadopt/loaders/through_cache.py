"""The `posix` backend's decoded samples read through the page cache, one sample at a time, in C.

Each finishing thread reads a sample's crop rows with one pread into a scratch buffer that stays in
its core's cache, then crops from there into the batch slot (`_native.read_crops`: no Python per
sample, the GIL released). Staging whole batches instead (the O_DIRECT path) sends every byte
through memory twice more, a batch being far larger than the cache: 0.25 of the memory copy rate
warm here, against 0.5-0.7 this way.

Reads try RWF_NOWAIT first (served only from the page cache). When a batch misses the cache:
- shards that fit in half the free memory are read in sequentially first (`prefill`): the disk's
  sequential rate, and the kernel fills the cache with large folios, which make every later read of
  a sample 2.2x cheaper here (8.3 against 18-20 us per 172 KB) than the 4 KiB pages that random
  reads or WILLNEED leave behind;
- otherwise the samples of the next `read_ahead` batches are announced to the kernel
  (POSIX_FADV_WILLNEED: read asynchronously, many requests deep). Announcing every batch, hit or
  miss, would cost a third of the warm rate here (the kernel walks every page of every sample).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil

from loadopt.errors import DatasetError
from loadopt.loaders import crops
from loadopt.storage.sequential import read_sequential

PREFILL_BLOCK = 8 << 20  # sequential reads this large make the kernel's readahead use large folios


def fits_in_memory(shards: list) -> bool:
    """Whether the shards take at most half of the memory available now."""
    return sum(os.path.getsize(shard) for shard in shards) <= psutil.virtual_memory().available // 2


def advise(loader, indices: np.ndarray) -> None:
    """POSIX_FADV_WILLNEED over the runs of these samples (a no-op for pages already cached)."""
    if not hasattr(os, "posix_fadvise"):
        return
    _, tasks, _ = loader.plan(indices)
    for shard, offset, _, nbytes in tasks:
        os.posix_fadvise(loader._reader.fds[shard], offset, nbytes, os.POSIX_FADV_WILLNEED)


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
    samples' reads on the loader's descriptors would break the sequential stream (then half as many
    large folios here)."""
    read_front_to_back(shards, PREFILL_BLOCK)


def read_front_to_back(shards: list, block: int, o_direct: bool = False) -> int:
    """Read each file from start to end, `block` bytes a read; returns the bytes read (the one
    sequential reader, storage/sequential.py)."""
    return read_sequential([str(shard) for shard in shards], block, direct=o_direct).nbytes


def produce(loader, batches: list[np.ndarray], epoch: int, free: queue.Queue, ready: queue.Queue,
            stop: threading.Event) -> None:
    """The producer of `PosixLoader` for decoded samples without O_DIRECT: fills free ring slots with
    `batches` in order and puts `(slot, indices, failures, bytes read)` on `ready`."""
    raw, size, stored = loader._raw, loader.pipeline.image_size, loader.size
    span = (size - 1) * stored * 3 + size * 3  # from a crop's first pixel to past its last
    read, fd_array = loader._reader.read, np.asarray(loader._reader.fds, np.int32)
    scratch = threading.local()
    nowait = [1]  # RWF_NOWAIT first; cleared where the kernel or filesystem does not support it
    depth, advised = loader.settings.read_ahead, 0
    prefill_allowed = loader.settings.prefill and fits_in_memory(raw.shards)
    if prefill_allowed and batches:
        # Before any sample is read: samples read at random first break the kernel's sequential
        # readahead at every one of them, and the prefill then leaves mostly small folios.
        first = batches[0][:8]
        if not all_cached(loader._reader.fds, list(zip(raw.shard[first].tolist(), raw.offset[first].tolist(),
                                                       strict=True)), span):
            prefill(raw.shards)
            prefill_allowed = False
    in_flight: collections.deque = collections.deque()

    def crop(out, shards: np.ndarray, offsets: np.ndarray, flags: np.ndarray, positions: np.ndarray) -> bool:
        """Read and crop these (consecutive) positions; whether any read missed the page cache."""
        if getattr(scratch, "buffer", None) is None:
            scratch.buffer = np.empty(span, np.uint8)
        first, last = int(positions[0]), int(positions[-1]) + 1
        misses, failed, _, usable = crops.native.read_crops(out, scratch.buffer, fd_array[shards], offsets, flags,
                                                            stored * 3, size, first, last, nowait[0])
        nowait[0] = nowait[0] if usable else 0
        if failed >= 0:  # read again here for the one-line error that names the shard
            read(int(shards[failed]), int(offsets[failed]), scratch.buffer)
            raise DatasetError(f"{raw.shards[shards[failed]]}: cannot read the sample at byte {offsets[failed]}")
        return misses > 0

    prefilled_through = -1  # batches up to this one were submitted before the prefill finished

    def hand_over(slot: int, indices: np.ndarray, running: list, n: int) -> None:
        nonlocal advised, prefilled_through, prefill_allowed
        missed = any([future.result() for future in running]) or not nowait[0]
        if missed and n <= prefilled_through:
            pass  # read while the prefill ran
        elif missed and prefill_allowed:
            prefill(raw.shards)
            prefill_allowed = False  # once an epoch: a later miss means the cache cannot hold them
            prefilled_through = n + len(in_flight)
        elif missed:
            for ahead in range(max(advised, n + 1), min(n + depth + 1, len(batches))):
                advise(loader, batches[ahead])
            advised = max(advised, n + depth + 1)
        ready.put((slot, indices, [], span * len(indices)))

    # Two batches in flight: the threads start on the next batch while the last pieces of this one
    # finish, instead of idling at every batch boundary.
    with ThreadPoolExecutor(loader.settings.threads, thread_name_prefix=f"loadopt-{loader.name}") as pool:
        for n, indices in enumerate(batches):
            if len(in_flight) == 2:
                hand_over(*in_flight.popleft())
            try:
                slot = free.get_nowait()
            except queue.Empty:  # the consumer holds the other slots: hand over what is in flight, then wait
                while in_flight:
                    hand_over(*in_flight.popleft())
                slot = free.get()
            if slot is None or stop.is_set():
                return
            tops, lefts, flips = crops.plan_crops(indices, stored - size, loader.pipeline.augment, loader.seed, epoch)
            args = (loader._ring[slot].numpy(), raw.shard[indices],
                    crops.crop_offsets(raw.offset[indices], tops, lefts, stored), flips.astype(np.uint8))
            chunks = np.array_split(np.arange(len(indices)), min(loader.settings.threads, len(indices)))
            running = [pool.submit(crop, *args, chunk) for chunk in chunks if len(chunk)]
            in_flight.append((slot, indices, running, n))
        while in_flight:
            hand_over(*in_flight.popleft())
