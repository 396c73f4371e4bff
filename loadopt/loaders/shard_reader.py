"""Reading the raw shards: a descriptor per shard, `preadv` into page-aligned staging (optionally O_DIRECT),
and that staging memory itself. The `posix` backend reads through a `ShardReader` (this one, or a tier's)."""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any, Protocol

import numpy as np

from loadopt.errors import DatasetError
from loadopt.storage.forms.raw_format import ALIGN, align_up

HUGE_PAGE = 2 << 20


def aligned_empty(nbytes: int) -> np.ndarray:
    """A zeroed uint8 buffer at a page boundary (private anonymous mmap), as O_DIRECT requires, in
    transparent huge pages where the kernel gives them (MADV_HUGEPAGE; a multiple of 2 MiB): an O_DIRECT
    read then pins a few huge pages instead of a page table walk and a bio segment per 4 KiB page (the
    shared anonymous map used before was shmem: 4 KiB pages and its slower pinning path)."""
    size = max(ALIGN, int(align_up(nbytes)))
    size = -(-size // HUGE_PAGE) * HUGE_PAGE if size >= HUGE_PAGE else size
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    # Not touched here: a loader allocates its staging every epoch and may never read into it (batches
    # cropped from the page cache); the reads fault in the pages they fill.
    return np.frombuffer(mapping, np.uint8)[: max(ALIGN, int(align_up(nbytes)))]


class ShardReader(Protocol):
    """Reads byte ranges of the shards into host or device memory (`PosixLoader.reader_class`)."""

    def read(self, shard: int, offset: int, out: Any) -> None: ...

    def close(self) -> None: ...


class PosixReader:
    """Reads (shard, offset, nbytes) tasks into host memory with os.preadv; one fd per shard."""

    def __init__(self, shards: list, o_direct: bool) -> None:
        self.shards, self.o_direct = shards, o_direct
        flags = os.O_RDONLY | (os.O_DIRECT if o_direct else 0)
        self.fds: list[int] = []
        try:
            for shard in shards:
                self.fds.append(self._open(shard, flags))
        except BaseException:
            self.close()
            raise

    def _open(self, shard, flags: int) -> int:
        try:
            return os.open(shard, flags)
        except OSError as exc:
            raise DatasetError(self._why(shard, exc)) from None

    def _why(self, shard, exc: OSError) -> str:
        if exc.errno == errno.EINVAL and self.o_direct:
            return f"{shard}: the filesystem refuses O_DIRECT (EINVAL; tmpfs?): set o_direct: false for this backend"
        return f"{shard}: cannot read ({exc.strerror or exc})"

    def read(self, shard: int, offset: int, out: np.ndarray) -> None:
        """Fill `out` (a uint8 view of the staging buffer, numpy or CPU tensor) from `offset` of shard `shard`."""
        view, done = np.asarray(out).data, 0
        while done < len(view):
            try:
                got = os.preadv(self.fds[shard], [view[done:]], offset + done)
            except OSError as exc:
                raise DatasetError(self._why(self.shards[shard], exc)) from None
            if got == 0:
                raise DatasetError(f"{self.shards[shard]}: ends at byte {offset + done}, the index needs "
                                   f"{offset + len(view)} (truncated shard)")
            done += got

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __del__(self, _close=os.close) -> None:  # a loader built only to convert (the bench's probe) is never closed
        # os.close bound at definition: at interpreter exit the module's globals may already be gone (None)
        for fd in getattr(self, "fds", None) or []:
            _close(fd)
        self.fds = []
