"""Page-cache control: evict a dataset's files for cold-cache runs (no root needed); unmap the pages of a
mapped file that a loader has read (`release_pages`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os

import numpy as np

_MADV_DONTNEED = 4  # linux/mman.h


def _libc(name: str):
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


_MADVISE = _libc("madvise")
_MINCORE = _libc("mincore")


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


def cached_bytes(paths: list[str]) -> int | None:
    """How many bytes of `paths` the page cache holds now (mincore over a fresh mapping of each); None where
    mincore is not available. Pages a live process maps, or writes not yet synced, stay after `evict`."""
    if _MINCORE is None:
        return None
    total = 0
    for path in paths:
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if not size:
                    continue
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            continue
        view = np.frombuffer(mapping, np.uint8)
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if _MINCORE(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0:
                total += min(size, sum(v & 1 for v in vec) * mmap.PAGESIZE)
        finally:
            del view  # the mapping's only export: it must go before the mapping can close
            mapping.close()
    return total


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


RESIDENCY_CHECKED_FILES = 1024  # an ImageFolder's million JPEGs: a mapping each would cost more than the run


def evict_for_cold(paths: list[str]) -> tuple[int, int | None]:
    """`evict`, checked: (files evicted, bytes still cached in up to `RESIDENCY_CHECKED_FILES` of them, evenly
    spaced). Pages a process still maps stay cached; a closed loader's mapping left to the garbage collector
    is the usual holder, so it is collected and evicted again."""
    checked = paths[::max(1, -(-len(paths) // RESIDENCY_CHECKED_FILES))]
    evicted, left = evict(paths), cached_bytes(checked)
    if left:
        gc.collect()
        evicted, left = evict(paths), cached_bytes(checked)
    return evicted, left


def cold_note(evicted: int, files: int, left: int | None) -> str:
    """What `evict_for_cold` did, for a run's note: a cold figure that was not all cold says so."""
    note = f"{evicted} of {files} files evicted from the page cache first"
    return note + (f" ({left / 1e6:,.1f} MB stayed cached: mapped by a live process)" if left else "")
