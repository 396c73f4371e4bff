"""The consumer's freed heap memory given back to the system every few batches (every backend's `host_batches`)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

# Batches between two returns of the consumer's free heap memory to the system (`release_free_heap`).
TRIM_EVERY = 32


def _libc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_free_heap() -> None:
    """Give the consumer's freed heap memory back to the system (glibc's `malloc_trim`; a no-op elsewhere):
    `host_batches` does every `TRIM_EVERY` batches, for every backend.

    Each batch handed out is fresh memory (the caller may keep it); glibc serves these multi-MB blocks from
    its heap once one has been freed (its mmap threshold rises to their size) and keeps what is freed:
    measured with benchmarks/scale.py (100k files, batches of 256 x 64 px uint8, 4 workers), the consumer's
    anonymous memory rose 80 -> 317 MB over 360 batches, all of it free (317 -> 47 MB after one trim), and
    the workers forked from it each epoch inherit that heap. A trim every `TRIM_EVERY` batches keeps it flat."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
