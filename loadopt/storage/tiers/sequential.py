"""The one sequential reader: files read front to back, one block after another, under a budget.

Used by `probe`'s sequential pattern, the bench's storage ceiling, the posix loader's prefill and
`benchmarks/raw_ceiling.py`'s sequential reference, so that each of them measures (or warms) the same way.

Local files are read with `os.preadv` into one page-aligned buffer (anonymous mmap, as O_DIRECT
requires), with O_DIRECT when asked and the file system allows it (tmpfs and some overlays refuse it:
those files are read buffered, and the result says so). Other fsspec locations (http, s3, emulated
tiers) are read with `cat_file(path, start, end)`, one block at a time.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

import fsspec

from loadopt.errors import DatasetError
from loadopt.storage.forms.raw_format import ALIGN, align_up

_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)  # what a file system that does not do O_DIRECT answers


class AlignedBuffer:
    """`nbytes` of private anonymous memory at a page boundary, as O_DIRECT requires, touched once so that
    no read pays its page faults. In 4 KiB pages, as fio's buffers are: the same reads into a
    transparent huge page (MADV_HUGEPAGE on a 2 MiB boundary) ran several times faster for 1 MiB O_DIRECT
    reads on a virtio disk (it gets one segment per page), so a buffer in huge pages would measure the
    probe against a different reader than fio's."""

    def __init__(self, nbytes: int) -> None:
        size = max(ALIGN, align_up(nbytes))
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        self.view[:] = bytes(size)

    def close(self) -> None:
        self.view.release()
        self._map.close()


class SequentialRead(NamedTuple):
    nbytes: int
    seconds: float
    direct: bool  # every local file was read with O_DIRECT


def read_sequential(paths: Sequence[str], block: int, *, fs: fsspec.AbstractFileSystem | None = None,
                    sizes: Sequence[int] | None = None, direct: bool = False, max_bytes: int | None = None,
                    max_seconds: float | None = None, passes: bool = False,
                    latencies: list[float] | None = None) -> SequentialRead:
    """Read `paths` in order, `block` bytes a read, until `max_bytes` are read or `max_seconds` have
    passed (each unlimited when None); with `passes`, pass after pass over the files (as fio's
    `time_based`) until one of the budgets ends. `fs` None: local paths, read with `os.preadv`
    (O_DIRECT when `direct`, buffered where the file system refuses it); otherwise read from `fs`
    with `cat_file` (`sizes`: the files' sizes, looked up when not given). `latencies`, when given,
    receives every read's seconds. A file that cannot be read raises DatasetError naming it."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    limit = max_bytes if max_bytes is not None else 1 << 62
    began = time.perf_counter()
    deadline = began + max_seconds if max_seconds is not None else float("inf")
    source: _Local | _Remote = _Local(block, direct) if fs is None else _Remote(fs, block, sizes)
    nbytes = 0
    try:
        while nbytes < limit and time.perf_counter() < deadline:
            before = nbytes
            for index, path in enumerate(paths):
                nbytes += source.read_file(index, path, limit - nbytes, deadline, latencies)
                if nbytes >= limit or time.perf_counter() >= deadline:
                    break
            if not passes or nbytes == before:  # one pass asked, or nothing to read (empty files)
                break
    finally:
        source.close()
    return SequentialRead(nbytes, time.perf_counter() - began, source.all_direct)


class _Local:
    """preadv into one page-aligned buffer, a descriptor per file while it is read."""

    def __init__(self, block: int, direct: bool) -> None:
        self.block, self.direct = block, direct
        self.all_direct = direct
        self._buffer = AlignedBuffer(block)
        self._view = self._buffer.view

    def read_file(self, _index: int, path: str, budget: int, deadline: float, latencies: list[float] | None) -> int:
        try:
            fd, direct = self._open(path)
            try:
                size = os.fstat(fd).st_size
                offset = 0
                while offset < size and offset < budget:
                    length = min(self.block, budget - offset)
                    length = align_up(length) if direct else length  # O_DIRECT reads whole pages
                    start = time.perf_counter()
                    try:
                        got = os.preadv(fd, [self._view[:length]], offset)
                    except OSError as exc:
                        if not direct or exc.errno not in _REFUSED or offset:
                            raise
                        os.close(fd)  # opened with O_DIRECT, refused at the first read: buffered
                        fd, direct = os.open(path, os.O_RDONLY), False
                        self.all_direct = False
                        continue
                    end = time.perf_counter()
                    if latencies is not None:
                        latencies.append(end - start)
                    if got == 0:
                        break
                    offset += got
                    if end >= deadline:
                        break
                return offset  # O_DIRECT: up to a page past the budget, counted as read
            finally:
                os.close(fd)
        except OSError as exc:  # e.g. a file removed under a running job
            raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None

    def _open(self, path: str) -> tuple[int, bool]:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno not in _REFUSED:
                    raise
                self.all_direct = False
        return os.open(path, os.O_RDONLY), False

    def close(self) -> None:
        self._buffer.close()


class _Remote:
    """`cat_file` ranges of an fsspec location."""

    all_direct = False

    def __init__(self, fs: fsspec.AbstractFileSystem, block: int, sizes: Sequence[int] | None) -> None:
        self.fs, self.block, self.sizes = fs, block, sizes

    def read_file(self, index: int, path: str, budget: int, deadline: float, latencies: list[float] | None) -> int:
        try:
            size = int(self.sizes[index]) if self.sizes is not None else int(self.fs.size(path) or 0)
            offset = 0
            while offset < min(size, budget):
                length = min(self.block, size - offset, budget - offset)
                start = time.perf_counter()
                got = len(self.fs.cat_file(path, start=offset, end=offset + length))
                end = time.perf_counter()
                if latencies is not None:
                    latencies.append(end - start)
                if got == 0:
                    break
                offset += got
                if end >= deadline:
                    break
            return offset
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{path}: cannot read ({exc})") from None

    def close(self) -> None:
        pass
