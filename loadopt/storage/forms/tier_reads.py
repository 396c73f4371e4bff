"""Reading a converted form through its storage tier.

On plain local disk (`storage.tier: local`, no `base`) a backend reads its converted files directly: memory
maps, `preadv`, O_DIRECT, cuFile (the fast paths). On any other tier every read of them goes through the tier's
filesystem object, so its bandwidth, latency, concurrency cap and faults apply and its counters see every byte: a
memory map cannot be gated page by page, so there the Arrow file is read one range request per sample (or per run
of adjacent samples) and raw shards one request per coalesced run, into the loader's staging memory.
"""

from __future__ import annotations

import mmap
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np

from loadopt.errors import DatasetError
from loadopt.storage.forms.arrow_outline import Outline
from loadopt.storage.remote.access import redact


class TierReader:
    """Reads (shard, offset, nbytes) ranges of files through a tier: the `PosixReader` interface over
    the tier's filesystem object (one request per read, retried and counted by the tier)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, shards: list[str]) -> None:
        self.fs, self.shards = fs, [str(s) for s in shards]

    def read(self, shard: int, offset: int, out) -> None:
        """Fill `out` (uint8 numpy array or CPU tensor) from byte `offset` of shard `shard`."""
        view = np.asarray(out).reshape(-1)
        data = self.fs.cat_file(self.shards[shard], start=offset, end=offset + len(view))
        if len(data) != len(view):
            raise DatasetError(f"{redact(self.shards[shard])}: ends at byte {offset + len(data)}, the index needs "
                               f"{offset + len(view)} (truncated file)")
        view[:] = np.frombuffer(data, np.uint8)

    def close(self) -> None:
        pass


def coalesce(offsets: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """(offset, nbytes) runs covering these byte ranges of one file, adjacent or overlapping ones merged."""
    order = np.argsort(offsets, kind="stable")
    o, e = offsets[order], offsets[order] + lengths[order]
    runs: list[tuple[int, int]] = []
    start, end = int(o[0]), int(e[0])
    for lo, hi in zip(o[1:].tolist(), e[1:].tolist(), strict=True):
        if lo > end:
            runs.append((start, end - start))
            start = lo
        end = max(end, hi)
    runs.append((start, end - start))
    return runs


# ---------------------------------------------------------------------------------------------
# Arrow files through a tier


class ShadowShards:
    """An image of each shard file of an Arrow conversion in anonymous memory whose samples' bytes are fetched
    through the tier when a batch needs them (`fetch`) and let go after (`drop`); everything else in the files
    (footers, record batch headers, labels, offsets: a few bytes a sample) is fetched through the tier once.
    The loaders build their usual zero-copy views over `record_batches()`, so every form reads through the tier
    with the code that reads the memory maps."""

    def __init__(self, fs: fsspec.AbstractFileSystem, paths: list[str], outlines: list[Outline],
                 threads: int = 8) -> None:
        self.fs, self.paths, self.threads = fs, paths, threads
        self.file_of = np.concatenate([np.full(len(o.offsets), k, np.int64) for k, o in enumerate(outlines)])
        self.offsets = np.concatenate([o.offsets for o in outlines])
        self.lengths = np.concatenate([o.lengths for o in outlines])
        self.buffers = [outline.image() for outline in outlines]
        self.views = [np.frombuffer(b, np.uint8)[:o.size] for b, o in zip(self.buffers, outlines, strict=True)]
        # The bytes besides the samples': from the outlines where they hold them, else fetched through the tier.
        gaps = [(k, int(at), int(n)) for k, o in enumerate(outlines) if o.data is None for at, n in o.runs.tolist()]
        self._read(gaps)
        self.fetched = sum(n for _, _, n in gaps)

    def record_batches(self) -> list:
        import pyarrow as pa

        batches = []
        for buffer in self.buffers:
            reader = pa.ipc.open_file(pa.py_buffer(buffer))
            batches += [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return batches

    def _read(self, runs: list[tuple[int, int, int]], pool: ThreadPoolExecutor | None = None) -> None:
        reader = TierReader(self.fs, self.paths)

        def read(run: tuple[int, int, int]) -> None:
            k, offset, nbytes = run
            reader.read(k, offset, self.views[k][offset : offset + nbytes])

        if pool is not None:
            list(pool.map(read, runs))
        elif len(runs) <= 1 or self.threads <= 1:
            for run in runs:
                read(run)
        else:
            with ThreadPoolExecutor(min(self.threads, len(runs)), thread_name_prefix="loadopt-tier") as own:
                list(own.map(read, runs))

    def fetch(self, indices: np.ndarray, pool: ThreadPoolExecutor | None = None) -> int:
        """Read the bytes of these samples through the tier into their place; returns the bytes read."""
        indices = np.asarray(indices)
        runs = []
        for k in np.unique(self.file_of[indices]).tolist():
            mine = indices[self.file_of[indices] == k]
            runs += [(k, offset, nbytes) for offset, nbytes in coalesce(self.offsets[mine], self.lengths[mine])]
        if pool is None:
            for run in runs:
                self._read([run])
        else:
            self._read(runs, pool)
        return sum(n for _, _, n in runs)

    def read(self, k: int, offset: int, nbytes: int) -> bytes:
        """`nbytes` at `offset` of shard file `k`, through the tier (not kept in the image)."""
        out = np.empty(nbytes, np.uint8)
        TierReader(self.fs, self.paths).read(k, offset, out)
        return out.tobytes()

    def where(self, k: int) -> str:
        return redact(self.fs.unstrip_protocol(self.paths[k]))

    def drop(self, indices: np.ndarray) -> None:
        """Give back the memory of the pages wholly inside these samples (they read as zeros until the
        next fetch; pages shared with other bytes of the file are kept)."""
        page = mmap.PAGESIZE
        for k, offset, nbytes in zip(self.file_of[indices].tolist(), self.offsets[indices].tolist(),
                                     self.lengths[indices].tolist(), strict=True):
            first, last = -(-offset // page) * page, (offset + nbytes) // page * page
            if last > first:
                self.buffers[k].madvise(mmap.MADV_DONTNEED, first, last - first)
