"""An Arrow shard's outline: where each sample's bytes are in the shard file, and every other byte of it (footer,
schema, record batch headers, ids, labels, offsets, frame dims: a few dozen bytes a sample). With it a reader
opens the shard's record batches from an image in anonymous memory and fetches only the samples' bytes from
wherever the file is (`ShadowShards`); it is what a machine keeps of an Arrow conversion whose shards are on
remote storage, as the index rows are for the raw form.

Saved beside the shard as `<shard>.outline.npz`: `samples` (n, 2) each sample's (offset, length) in sample order,
`runs` (m, 2) the other bytes' (offset, length), `data` those bytes back to back, `size` the file's size."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadopt.errors import DatasetError
from loadopt.storage.forms import integrity, shard_work


def outline_name(k: int) -> str:
    return f"{shard_work.shard_stem(k)}.outline.npz"


def arrow_layout(files: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard file, offset, length) of each sample's bytes (the last column) in the local Arrow shard files, in
    sample order, from their memory maps (only metadata pages and variable-width offsets are touched)."""
    import pyarrow as pa

    from loadopt.storage.forms.arrow_format import (
        mapped_shard,  # here: arrow_format imports tier_reads, which imports this
    )

    owners, offsets, lengths = [], [], []
    for k, path in enumerate(files):
        mapped, base = mapped_shard(path)
        reader = pa.ipc.open_file(mapped)
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            column = batch.column(batch.num_columns - 1)
            rows, kind = batch.num_rows, column.type
            owners.append(np.full(rows, k, np.int64))
            if pa.types.is_fixed_size_binary(kind):  # rows back to back
                width = kind.byte_width
                first = column.buffers()[1].address + column.offset * width - base
                offsets.append(first + np.arange(rows, dtype=np.int64) * width)
                lengths.append(np.full(rows, width, np.int64))
            else:  # (large) binary: offsets into the data buffer
                dtype = np.int64 if pa.types.is_large_binary(kind) else np.int32
                item = np.dtype(dtype).itemsize
                bounds = np.frombuffer(column.buffers()[1], dtype, rows + 1, column.offset * item).astype(np.int64)
                offsets.append(column.buffers()[2].address - base + bounds[:-1])
                lengths.append(np.diff(bounds))
    empty = np.zeros(0, np.int64)
    return (np.concatenate(owners) if owners else empty, np.concatenate(offsets) if offsets else empty,
            np.concatenate(lengths) if lengths else empty)


def other_runs(offsets: np.ndarray, lengths: np.ndarray, size: int) -> np.ndarray:
    """(offset, length) of each run of a file of `size` bytes outside the samples' bytes (`offsets`, `lengths`)."""
    order = np.argsort(offsets, kind="stable")
    starts = np.r_[0, offsets[order] + lengths[order]].astype(np.int64)
    ends = np.r_[offsets[order], size].astype(np.int64)
    keep = ends > starts
    return np.stack([starts[keep], (ends - starts)[keep]], axis=1) if keep.any() else np.zeros((0, 2), np.int64)


@dataclass
class Outline:
    """One shard file's outline (see the module); `data` None: the other bytes are to be fetched too."""

    size: int
    offsets: np.ndarray
    lengths: np.ndarray
    runs: np.ndarray
    data: np.ndarray | None = None

    @classmethod
    def of(cls, shard: Path, with_bytes: bool = False) -> Outline:
        """The outline of a local shard file (`with_bytes`: its other bytes read too)."""
        _, offsets, lengths = arrow_layout([shard])
        size = shard.stat().st_size
        runs = other_runs(offsets, lengths, size)
        data = None
        if with_bytes:
            with open(shard, "rb") as file:
                data = np.frombuffer(b"".join(os.pread(file.fileno(), int(n), int(at)) for at, n in runs), np.uint8)
        return cls(size, offsets, lengths, runs, data)

    def save(self, path: Path) -> None:
        """Written under a temporary name, then renamed."""
        assert self.data is not None, "an outline is saved with its bytes"
        tmp = integrity.temp_path(path)
        with open(tmp, "wb") as out:
            np.savez(out, samples=np.stack([self.offsets, self.lengths], axis=1), runs=self.runs, data=self.data,
                     size=np.int64(self.size))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Outline:
        try:
            with np.load(path, allow_pickle=False) as saved:
                samples = saved["samples"].reshape(-1, 2)
                return cls(int(saved["size"]), samples[:, 0].copy(), samples[:, 1].copy(), saved["runs"].reshape(-1, 2),
                           saved["data"])
        except FileNotFoundError:
            raise DatasetError(f"{path}: the outline of an Arrow shard is missing: rebuild the conversion with "
                               "`loadopt convert CONFIG --to arrow --force ...`") from None
        except (OSError, ValueError, KeyError) as exc:
            raise DatasetError(f"{path}: damaged outline of an Arrow shard ({type(exc).__name__}): rebuild the "
                               "conversion with `loadopt convert CONFIG --to arrow --force ...`") from None

    def image(self) -> mmap.mmap:
        """The file's image in anonymous memory: its other bytes in place (from `data`), the samples' zero."""
        image = mmap.mmap(-1, max(self.size, 1))
        if self.data is not None:
            view, at = np.frombuffer(image, np.uint8), 0
            for offset, nbytes in self.runs.tolist():
                view[offset : offset + nbytes] = self.data[at : at + nbytes]
                at += nbytes
            del view
        return image
