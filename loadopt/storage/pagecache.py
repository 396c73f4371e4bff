"""Page-cache control: evict a dataset's files for cold-cache runs (no root needed); unmap the pages of a
mapped file that a loader has read (`release_pages`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

_MADV_DONTNEED = 4  # linux/mman.h


def _libc_madvise():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None


_MADVISE = _libc_madvise()


def release_pages(view: np.ndarray) -> None:
    """Drop this process's mapping of the whole pages under `view` (a numpy view of a read-only file
    mapping; madvise DONTNEED): they leave its memory (RSS, PSS) and stay in the page cache, so reading
    them again is a minor fault, not a disk read. A no-op where madvise is not available."""
    if _MADVISE is None or view.nbytes == 0:
        return
    start = view.ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the view only
    last = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _MADVISE(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def evict(paths: list[str]) -> int:
    """Drop `paths` from the page cache (posix_fadvise DONTNEED); returns how many were evicted.

    Dirty pages cannot be dropped, so each file is synced first (a no-op for files long written).
    """
    evicted = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            evicted += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return evicted
