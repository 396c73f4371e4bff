"""The counters of a shard cache (`ShardCacheFileSystem`), one set across threads and processes: what it
served from its copies, what it fetched (on demand or ahead) and what it evicted.

They live in a small file mapped shared (in /dev/shm when there is one), updated under `flock`, as the
tier's counters do (`SharedTierState`); each process opens its own descriptor, since a forked child's
copy would share the parent's lock. The folder travels with the cache when it is pickled, so a spawned
process adds to the same counters.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CacheCounters:
    """What the cache did, summed over every process reading through it."""

    hit_reads: int = 0  # reads served from a copy that was there
    hit_bytes: int = 0
    miss_reads: int = 0  # reads that found no copy (then fetched, or read through)
    miss_bytes: int = 0
    uncached_reads: int = 0  # misses read through: a file over the limit, or no room that could be made
    fetched_files: int = 0  # whole files fetched into the cache, on demand or ahead
    fetched_bytes: int = 0
    ahead_files: int = 0  # of those, fetched ahead by `prefetch`
    ahead_bytes: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0
    dead_temps: int = 0  # temporary files of killed fetches removed
    derived_files: int = 0  # forms made once from copies and kept beside them (`ShardCacheFileSystem.derived`)
    derived_bytes: int = 0

    def as_counters(self) -> dict[str, float]:
        """Under `cache_` names, as a tier's counters are kept (merged into them by `tiers.tier_counters`)."""
        return {f"cache_{name}": float(value) for name, value in asdict(self).items()}


NAMES = tuple(CacheCounters.__dataclass_fields__)

# Serialises a process's first use (two threads attaching at once would map twice); a fresh one in a forked
# child, where the parent's could be held by a thread that does not exist there.
_ATTACH_LOCK = threading.Lock()


def _fresh_attach_lock() -> None:
    global _ATTACH_LOCK
    _ATTACH_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_attach_lock)


class SharedCounts:
    """`CacheCounters` kept in `folder`, shared by every process that names the same folder."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder, self._pid = Path(folder), -1

    def _attach(self) -> None:
        if self._pid == os.getpid():
            return
        with _ATTACH_LOCK:
            if self._pid != os.getpid():
                self.folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.folder / "counters", os.O_RDWR | os.O_CREAT, 0o600)
                os.ftruncate(fd, max(os.fstat(fd).st_size, 8 * len(NAMES)))
                self._fd, self._lock = fd, threading.Lock()
                self._values = memoryview(mmap.mmap(fd, 8 * len(NAMES), mmap.MAP_SHARED)).cast("q")
                self._pid = os.getpid()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[memoryview]:
        self._attach()
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._values
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def add(self, **counts: int) -> None:
        with self._locked() as values:
            for name, value in counts.items():
                values[NAMES.index(name)] += int(value)

    def read(self) -> CacheCounters:
        with self._locked() as values:
            return CacheCounters(*values.tolist())
