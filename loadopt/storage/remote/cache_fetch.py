"""Fetching one file into the shard cache as range requests, several at once
(`RangedFetch`): an object store limits each connection, not the link, so a file comes in at the link's rate
only when its ranges are requested together. The ranges land in the file's reservation at their own offsets
in any order; the copy is published when the last one is in, and given up when any fails or the fetch is
stopped."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import fsspec

from loadopt.storage.remote.cache_folder import CacheFolder, Reservation

CHUNK_BYTES = 8 << 20  # a range request's bytes at most (as AWS's own clients split an object)
RANGE_MIN_BYTES = 1 << 20  # ... and at least: a small file is one request, not many paying their first byte


def file_ranges(size: int, parts: int) -> list[tuple[int, int]]:
    """The (start, end) range requests of a file of `size` bytes: `parts` of them where that keeps each between
    RANGE_MIN_BYTES and CHUNK_BYTES."""
    step = min(CHUNK_BYTES, max(RANGE_MIN_BYTES, -(-size // max(1, parts))))
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class RangedFetch:
    """One file being fetched through `tier` into `reservation` of `store`, range by range (`fetch(start, end)`,
    from any thread); `done` is set once every range has ended, `outcome()` then says how it went."""

    def __init__(self, tier: fsspec.AbstractFileSystem, store: CacheFolder, path: str, reservation: Reservation,
                 parts: int, stop: threading.Event | None, published: Callable[[int], None]) -> None:
        self.tier, self.store, self.path, self.reservation = tier, store, path, reservation
        self.ranges = file_ranges(reservation.size, parts)
        self.stop, self.published = stop, published
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._left = len(self.ranges)
        self._read_error: BaseException | None = None
        self._write_error: OSError | None = None
        self._short = False
        self._kept = False
        if not self.ranges:  # an empty file: nothing to request
            self._finish()

    def fetch(self, start: int, end: int) -> None:
        """Request bytes start..end-1 and write them at their place (nothing once the fetch failed or stopped)."""
        try:
            if not self._failed() and not (self.stop is not None and self.stop.is_set()):
                data = self.tier.cat_file(self.path, start=start, end=end)
                if len(data) != end - start:
                    self._short = True  # the storage gave other than its size: the file changed
                else:
                    try:
                        _pwrite_all(self.reservation.fd, data, start)
                    except OSError as exc:
                        self._write_error = exc
        except BaseException as exc:  # noqa: BLE001 - met by the reader waiting on this fetch (outcome())
            self._read_error = exc
        finally:
            self.skip(1)

    def skip(self, count: int) -> None:
        """`count` ranges that will not be requested (the fetch was stopped before them) or have ended."""
        with self._lock:
            self._left -= count
            last = self._left == 0
        if last:
            self._finish()

    def _failed(self) -> bool:
        return self._read_error is not None or self._write_error is not None or self._short

    def _finish(self) -> None:
        stopped = self.stop is not None and self.stop.is_set()
        if self._failed() or stopped:
            self.store.abandon(self.reservation)
        else:
            try:
                self.store.publish(self.reservation)  # gives the reservation up itself when it fails
                self._kept = True
                self.published(self.reservation.size)
            except OSError as exc:
                self._write_error = exc
        self.done.set()

    def outcome(self) -> tuple[bool, OSError | None]:
        """(kept, the write error that kept it out: a full disk): raises the storage's error of a range."""
        self.done.wait()
        if self._read_error is not None:
            raise self._read_error
        return self._kept, self._write_error

    @property
    def changed(self) -> bool:
        """Whether the storage gave a range other than its size (the file changed since its size was read)."""
        return self._short
