"""The JPEGs of a cached tar shard's JPEG XL members, rebuilt once and kept beside its copy in the shard cache.

A recompressed shard (`loadopt recompress`) gives back each JPEG by rebuilding it from its JPEG XL, a CPU-bound
step, on every read: from the shard cache a job of many epochs would pay it every epoch. Instead the first reader
of a JPEG XL member of a cached shard rebuilds all of the shard's JPEG XL members into one file beside the copy
(`ShardCacheFileSystem.derived`: counted in the cache's limit, evicted as the copies are): the JPEGs one after
another, then a table of (member offset, start, length) rows, their count and a marker. Every later read, by any
process, is one `pread` of the JPEG. Another process's reads while a shard is being rebuilt rebuild their own
member, as before.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

import fsspec
import numpy as np

from loadopt.imaging import jxl
from loadopt.storage.remote.cache_folder import let_go

KIND = "jpegs"  # the derived form's name beside the copy
MARKER = b"LOJPEGS1"
ROW = np.dtype([("offset", "<i8"), ("start", "<i8"), ("length", "<i8")])
TAIL = 8 + len(MARKER)  # the row count, then the marker

# Members of a shard: the offsets and lengths of its image members' data.
Members = tuple[np.ndarray, np.ndarray]


def room_for(sizes: np.ndarray) -> int:
    """The bytes reserved for a shard's rebuilt JPEGs: twice its members' (a JPEG is about 1.25x its JPEG XL),
    with the table; a member that would not fit is left out (read and rebuilt as before)."""
    return 2 * int(sizes.sum()) + ROW.itemsize * len(sizes) + TAIL


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_rebuilt(copy_fd: int, out_fd: int, offsets: np.ndarray, sizes: np.ndarray) -> None:
    """The JPEGs of the JPEG XL members at `offsets` (`sizes` bytes) of the shard open as `copy_fd`, then the table."""
    room = room_for(sizes) - ROW.itemsize * len(sizes) - TAIL
    rows, position = [], 0
    for offset, size in zip(offsets.tolist(), sizes.tolist(), strict=True):
        data = os.pread(copy_fd, size, offset)
        if len(data) != size or not jxl.is_jxl(data):
            continue  # a JPEG kept as it was (or another image) is read from the copy itself
        jpeg = jxl.decodable(data)
        if position + len(jpeg) > room:
            continue
        _write_all(out_fd, jpeg)
        rows.append((offset, position, len(jpeg)))
        position += len(jpeg)
    _write_all(out_fd, np.array(rows, dtype=ROW).tobytes() + struct.pack("<q", len(rows)) + MARKER)


def read_table(fd: int) -> dict[int, tuple[int, int]]:
    """member offset -> (start, length) of the rebuilt JPEGs open as `fd`; empty for a file that is not one."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, TAIL, size - TAIL) if size >= TAIL else b""
    if tail[8:] != MARKER:
        return {}
    (count,) = struct.unpack("<q", tail[:8])
    table = np.frombuffer(os.pread(fd, count * ROW.itemsize, size - TAIL - count * ROW.itemsize), dtype=ROW)
    return dict(zip(table["offset"].tolist(), zip(table["start"].tolist(), table["length"].tolist(), strict=True),
                    strict=True))


class RebuiltJpegs:
    """The rebuilt JPEGs of the shards one process has read through `fs` (a shard cache), their tables kept."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs
        self._tables: dict[str, dict[int, tuple[int, int]]] = {}
        self._members: dict[str, Members] = {}

    @staticmethod
    def applies(fs: fsspec.AbstractFileSystem) -> bool:
        """Whether `fs` keeps derived forms beside its copies (the shard cache)."""
        return callable(getattr(fs, "derived", None))

    def known(self, shard: str, offset: int) -> bytes | None:
        """The member's JPEG where the shard's JPEGs were rebuilt (by any process) and are still kept; None otherwise,
        without reading the shard's copy (which may have been evicted since)."""
        table = self._tables.get(shard)
        if table is not None and offset not in table:
            return None
        return self._read(shard, offset, None)

    def rebuilt(self, shard: str, offset: int, members: Callable[[], Members]) -> bytes | None:
        """The JPEG of the JPEG XL member at `offset` of `shard`, rebuilding the shard's members (`members()`) into the
        cache first where no process has; None where it cannot be kept now (the caller rebuilds the one member)."""
        return self._read(shard, offset, members)

    def _read(self, shard: str, offset: int, members: Callable[[], Members] | None) -> bytes | None:
        derived = self.fs.derived  # `applies` checked it
        if members is None:
            fd = derived(shard, KIND, None, 0)
        else:
            if shard not in self._members:
                self._members[shard] = members()
            offsets, sizes = self._members[shard]
            fd = derived(shard, KIND, lambda copy, out: write_rebuilt(copy, out, offsets, sizes), room_for(sizes))
        if fd is None:
            return None
        try:
            table = self._tables.get(shard)
            if table is None:
                table = self._tables[shard] = read_table(fd)
            found = table.get(offset)
            if found is None:
                return None
            start, length = found
            data = os.pread(fd, length, start)
            return data if len(data) == length else None
        finally:
            let_go(fd)
