"""Where each sample's stored bytes are in an opened Arrow conversion (`ArrowColumn`): the byte source of the
arrow backend's fillers.

A rank holds only its share of the index. The samples' offsets are read piece by piece when first located, a piece
being the rows of one source shard within one record batch (the runs a rank is dealt under the window shuffle):
read from the shard file with `pread` into arrays of its own where the shard is a local file (a mapped page of
offsets is shared by two ranks' runs, and holding whole pages made a rank's index 2x its share), copied from the
file's image where it is one. Nothing is concatenated over the whole dataset (at a billion samples that would be
8-16 GB a rank). Frame dims stay views of the mapped file, counted by the page. `index_bytes_read` counts what
a rank holds, as `raw_format.RawIndex` does for the raw form; `forget` lets go of the pieces (each epoch)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa

from loadopt.imaging.frames import FRAME_FIELDS
from loadopt.loaders.fillers import Located

_PAGE = 4096


class ArrowColumn:
    """The samples' stored bytes (the last column) of an opened Arrow conversion's record batches. A fixed-size
    column (centre squares, token windows) is one zero-copy array over each shard file, so a batch is one gather,
    not one per record batch (a batch of 32 windows touches ~28 record batches of the default corpus); a
    variable-length one (whole frames, JPEGs, records) an array per record batch, each sample's start and length
    read from the batch's offsets when it is located."""

    def __init__(self, batches: list[pa.RecordBatch], batch_file: np.ndarray, runs: np.ndarray | None = None,
                 files: list[Path] | None = None, offsets_at: np.ndarray | None = None) -> None:
        """`runs`: the first sample of each source shard (the shard table's bounds; None: a piece per record
        batch); `files` and `offsets_at`: each batch's shard file and where its offsets start in it (-1, or none
        given: copied from the batch's own buffer)."""
        self.batches, self._batch_file = batches, batch_file.copy()
        self.first_rows = np.cumsum([0] + [b.num_rows for b in batches])[:-1].astype(np.int64)
        self.columns = [b.column(b.num_columns - 1) for b in batches]
        kind = self.columns[0].type
        self.width: int | None = kind.byte_width if pa.types.is_fixed_size_binary(kind) else None
        self.bounds: list[np.ndarray] = []  # variable length: each record batch's offsets (rows + 1), mapped
        if self.width is not None:  # one array per shard file: each is a mapping of its own
            self.sources: list[np.ndarray] = []
            self.bases, self.source_of = np.zeros(len(batches), np.int64), batch_file
            for k in np.unique(batch_file).tolist():
                mine = np.flatnonzero(batch_file == k)
                span, self.bases[mine] = _spanning_view([self.columns[b] for b in mine], self.width)
                self.source_of[mine] = len(self.sources)
                self.sources += span
        else:  # binary (int32 offsets: JPEGs) or large binary (int64: frames, records)
            self.sources = [np.frombuffer(c.buffers()[2], np.uint8) for c in self.columns]
            for c in self.columns:
                item = 8 if pa.types.is_large_binary(c.type) else 4
                self.bounds.append(np.frombuffer(c.buffers()[1], np.int64 if item == 8 else np.int32, len(c) + 1,
                                                 c.offset * item))
        names = batches[0].schema.names if batches else []
        # whole frames: each record batch's (height, width, source height, source width) columns, mapped
        self.dims: list[list[np.ndarray]] | None = [[b.column(name).to_numpy() for name in FRAME_FIELDS]
                                                    for b in batches] \
            if batches and all(n in names for n in FRAME_FIELDS) else None
        # the frame dims' pages located so far: per (record batch, column), a flag per page of the column
        self._pages: dict[tuple[int, int], np.ndarray] = {}
        self._samples = int(self.first_rows[-1] + batches[-1].num_rows) if batches else 0
        cuts = self.first_rows if runs is None else np.union1d(self.first_rows, np.asarray(runs, np.int64))
        self.piece_first = np.asarray(cuts[cuts < self._samples], np.int64)  # each piece's first sample
        self._files, self._offsets_at = files, offsets_at
        self._pieces: dict[int, np.ndarray] = {}  # piece -> its rows' offsets and the next one, held
        self._reading = threading.Lock()

    def locate(self, indices: np.ndarray) -> Located[np.ndarray]:
        """The samples' stored bytes: views of the mapped (or fetched) file, read when touched."""
        indices = np.asarray(indices, np.int64)
        which = np.searchsorted(self.first_rows, indices, side="right") - 1
        rows = indices - self.first_rows[which]
        frames = self._frames(which, rows) if self.dims is not None else None
        if self.width is not None:
            starts = self.bases[which] + rows * self.width
            lengths = np.full(len(indices), self.width, np.int64)
            return Located(self.sources, self.source_of[which].astype(np.int32), starts, lengths,
                           int(lengths.sum()), frames, mapped=True)
        starts, ends = np.empty(len(indices), np.int64), np.empty(len(indices), np.int64)
        piece = np.searchsorted(self.piece_first, indices, side="right") - 1
        for p, mine in _by_batch(piece):
            offsets = self._pieces.get(p)
            if offsets is None:
                offsets = self._read_piece(p)
            at = indices[mine] - self.piece_first[p]
            starts[mine], ends[mine] = offsets[at], offsets[at + 1]
        lengths = ends - starts
        return Located(self.sources, which, starts, lengths, int(lengths.sum()), frames, mapped=True)

    def _read_piece(self, p: int) -> np.ndarray:
        """Piece `p`'s offsets (its rows and the one after), read from the shard file or copied, and kept."""
        first = int(self.piece_first[p])
        b = int(np.searchsorted(self.first_rows, first, side="right")) - 1
        bounds, lo = self.bounds[b], first - int(self.first_rows[b])
        end = int(self.piece_first[p + 1]) if p + 1 < len(self.piece_first) else self._samples
        count = end - first + 1
        at = -1 if self._offsets_at is None else int(self._offsets_at[b])
        if at < 0 or self._files is None:
            offsets = bounds[lo:lo + count].copy()
        else:  # from the file, not through its mapping: no page of a neighbour's rows held here
            fd = os.open(self._files[int(self._batch_file[b])], os.O_RDONLY)
            try:
                data = os.pread(fd, count * bounds.itemsize, at + lo * bounds.itemsize)
            finally:
                os.close(fd)
            offsets = np.frombuffer(data, bounds.dtype).copy()
        with self._reading:
            return self._pieces.setdefault(p, offsets)

    def forget(self) -> None:
        """Let go of the offsets read so far (a new epoch deals other runs to this rank)."""
        with self._reading:
            self._pieces = {}

    def _frames(self, which: np.ndarray, rows: np.ndarray) -> np.ndarray:
        assert self.dims is not None, "whole frames only"
        out = np.empty((len(which), len(FRAME_FIELDS)), np.int32)
        for b, mine in _by_batch(which):
            for f, column in enumerate(self.dims[b]):
                out[mine, f] = column[rows[mine]]
                self._touch(b, f, column, rows[mine])
        return out

    def _touch(self, batch: int, column: int, array: np.ndarray, rows: np.ndarray) -> None:
        """Flag the pages of `array` (a mapped index column) holding `rows` (one vectorised store a batch: the
        consumer's thread does this for every batch)."""
        skew = array.__array_interface__["data"][0] % _PAGE  # where the column starts in its first page
        flags = self._pages.get((batch, column))
        if flags is None:
            flags = self._pages[(batch, column)] = np.zeros((skew + array.nbytes) // _PAGE + 1, bool)
        flags[(skew + rows * array.itemsize) // _PAGE] = True

    def index_bytes_read(self) -> int:
        """The index this reader holds: the offsets of the pieces it located (since `forget`), the 4 KiB pages of
        frame dims holding its rows, and its tables of record batches and pieces (what a rank of a web-scale
        dataset holds, against `index_bytes`)."""
        held = sum(offsets.nbytes for offsets in list(self._pieces.values()))
        pages = sum(int(flags.sum()) for flags in list(self._pages.values()))
        return held + pages * _PAGE + self.first_rows.nbytes + self.piece_first.nbytes

    def index_bytes(self) -> int:
        """The whole conversion's index: every record batch's offsets and frame dims."""
        dims = sum(c.nbytes for batch in self.dims for c in batch) if self.dims is not None else 0
        return sum(b.nbytes for b in self.bounds) + dims


def _by_batch(which: np.ndarray):
    """(record batch, the positions in it) of each record batch among `which`, in one sort."""
    order = np.argsort(which, kind="stable")
    cuts = np.flatnonzero(np.diff(which[order])) + 1
    for group in np.split(order, cuts):
        if len(group):
            yield int(which[group[0]]), group


def _spanning_view(columns: list, width: int) -> tuple[list[np.ndarray], np.ndarray]:
    """([one uint8 array over every column's fixed-size values], each column's first value's offset in it): the
    columns of one shard file."""
    addresses = [c.buffers()[1].address + c.offset * width for c in columns]
    first = min(addresses)
    end = max(a + len(c) * width for a, c in zip(addresses, columns, strict=True))
    # The record batches sit in one memory map (or file image); the buffer keeps them (and so the map) alive.
    span = np.frombuffer(pa.foreign_buffer(first, end - first, base=columns), np.uint8)
    return [span], np.array(addresses, np.int64) - first
