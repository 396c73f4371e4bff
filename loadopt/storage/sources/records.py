"""Record workloads (`dataset.kind: records`): samples of a stated size in files, as DLIO and MLPerf
Storage describe their workloads (unet3d, resnet50, cosmoflow).

A record folder holds files of `samples_per_file` records each, `raw` (the records back to back) or
`npz` (numpy's zip of an `x` array: one row per record, or DLIO's npz generator's layout, (dim1, dim2,
samples) with record i = x[..., i], so loadopt reads the files DLIO generated). All records of
one file share a size, drawn per file from a normal distribution of `record_bytes` and
`record_bytes_stdev` (DLIO's `record_length_bytes` and `record_length_bytes_stdev`), so sizes spread as
in the published workloads. `scale` multiplies the sizes (and `workload.accelerator`'s step time, in
`loadopt.config`): a scaled-down workload asks each accelerator for the published bytes per second.

Each sample is delivered as `delivered_bytes` bytes (its first bytes, zero-padded: DLIO's
`record_length_bytes_resize`, what its reader hands the emulated accelerator), so batches stack. A raw
file is read by the sample's own byte range; an npz file is opened and parsed whole, as DLIO's npz
reader does (its bytes count as read: the goodput shows it). The synthetic folder is generated once
into the cache, seeded, under a temporary name renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np

from loadopt.config_models import RecordSpec
from loadopt.errors import DatasetError
from loadopt.files import cache_dir, honour_umask, is_no_space
from loadopt.storage.remote import listing as remote_listing
from loadopt.storage.remote.access import display_name, is_local_fs, open_url, redact, storage_errors, why_missing
from loadopt.storage.remote.listing import ListingKey, SavedListing
from loadopt.storage.sources.request import SourceRequest

GENERATOR_VERSION = 1
MIN_RECORD_BYTES = 1024  # a draw below this (the normal's left tail) is clipped to it
RECORD_EXTENSIONS = {"raw": ".bin", "npz": ".npz"}


@dataclass
class RecordDataset:
    """The records of a folder of record files; the interface the loaders use for image datasets."""

    root: str
    fs: fsspec.AbstractFileSystem
    files: np.ndarray  # fixed-width UTF-8 bytes, one per file, as `fs` names them
    file_bytes: np.ndarray  # int64, each file's size
    file_of: np.ndarray  # int64, the file of each sample
    row_of: np.ndarray  # int64, the sample's row in its file
    sizes: np.ndarray  # int64, stored bytes of each record
    file_format: str  # raw | npz
    delivered_bytes: int
    fingerprint: str
    synthetic: bool = False
    classes: list[str] = field(default_factory=list)
    converted: str | None = None
    left_out: list[str] = field(default_factory=list)  # samples indexing left out (on_error: skip), named
    listed_at: float | None = None  # when its saved remote listing was taken
    shard_bounds: np.ndarray | None = None  # where each file's records start (then their count): its shard table
    kind: ClassVar[str] = "records"
    source_format: ClassVar[str] = "records"

    def __post_init__(self) -> None:
        self.labels = np.zeros(len(self.sizes), dtype=np.int64)  # records carry no class; kept for the protocol

    def __len__(self) -> int:
        return len(self.sizes)

    def path(self, index: int) -> str:
        return f"{self.files[self.file_of[index]].decode()} (record {int(self.row_of[index])})"

    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def local_files(self) -> list[str]:
        return [f.decode() for f in self.files] if self.is_local() else []

    def read(self, index: int) -> bytes:
        """Record `index`'s stored bytes (the Dataset protocol's question; `read_record` says what it cost)."""
        return self.read_record(index)[0].tobytes()

    def read_record(self, index: int) -> tuple[np.ndarray, int]:
        """Record `index`'s bytes (a uint8 array) and the bytes read from storage to get them."""
        name = self.files[self.file_of[index]].decode()
        row, size = int(self.row_of[index]), int(self.sizes[index])
        try:
            shown, listed_at = display_name(self.fs, name), self.listed_at
            if self.file_format == "raw":
                data = remote_listing.read_listed(self.fs, name, shown, listed_at, size, row * size, (row + 1) * size)
                if len(data) != size:
                    raise DatasetError(f"{redact(name)}: record {row} is cut short ({len(data)} of {size} bytes)")
                return np.frombuffer(data, dtype=np.uint8), size
            # Parsed from the open file, as DLIO's reader does (reading it into a buffer first and parsing
            # that copy costs two fresh buffers of the file's size per sample).
            whole = int(self.file_bytes[self.file_of[index]])
            with remote_listing.open_listed(self.fs, name, shown, listed_at, whole) as handle, \
                    np.load(handle) as archive:
                rows = archive["x"]  # the whole file is read for its `x`
            if rows.ndim == 3 and row < rows.shape[2]:  # DLIO's layout: (dim1, dim2, samples)
                return np.ascontiguousarray(rows[..., row]).reshape(-1).view(np.uint8), whole
            if rows.ndim != 2 or row >= len(rows):
                raise DatasetError(f"{redact(name)}: not a record file of this layout (an `x` array of "
                                   f"records, one per row, or DLIO's (dim1, dim2, samples); found shape {rows.shape})")
            return rows[row].view(np.uint8), whole
        except DatasetError:
            raise
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:  # missing file, bad zip, no `x`
            raise DatasetError(f"{redact(name)}: cannot read record {row} ({exc})") from None

    def read_into(self, index: int, out: np.ndarray) -> int:
        """Record `index` delivered into `out` (`delivered_bytes` uint8: its first bytes, zero-padded); the
        bytes read from storage for it returned. A loader filling a batch this way holds one record's
        storage buffer at a time, as DLIO's reader does: holding a batch of them until the batch is stacked
        (4 x 1.5 MB npz arrays) made the heap give them back to the system after every batch and fault them
        in again (2,770 page faults and 10 ms of worker CPU a batch of 4 against 1,090 and 5.9 ms, measured
        by benchmarks/dlio_crosscheck.py's workload)."""
        size = int(self.sizes[index])
        if self.file_format == "raw" and size <= len(out) and self.is_local():
            name, row = self.files[self.file_of[index]].decode(), int(self.row_of[index])
            try:  # straight into `out`: no intermediate buffer
                fd = os.open(name, os.O_RDONLY)
                try:
                    got = os.preadv(fd, [out[:size].data], row * size)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise DatasetError(f"{redact(name)}: cannot read record {row} ({exc})") from None
            if got != size:
                raise DatasetError(f"{redact(name)}: record {row} is cut short ({got} of {size} bytes)")
            out[size:] = 0
            return size
        record, read = self.read_record(index)
        self.deliver(record, out)
        return read

    def deliver(self, record: np.ndarray, out: np.ndarray) -> None:
        """The delivered form of `record` written into `out` (`delivered_bytes` uint8): its first bytes."""
        count = min(len(record), len(out))
        out[:count] = record[:count]
        out[count:] = 0


def record_sizes(spec: RecordSpec) -> np.ndarray:
    """The record size of each file (bytes; all records of a file share it), drawn seeded per file."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    mean, stdev = spec.record_bytes * spec.scale, spec.record_bytes_stdev * spec.scale
    sizes = rng.normal(mean, stdev, spec.num_files) if stdev > 0 else np.full(spec.num_files, mean)
    return np.maximum(MIN_RECORD_BYTES, np.rint(sizes)).astype(np.int64)


def _key(spec: RecordSpec) -> str:
    wanted = spec.model_dump(exclude={"delivered_bytes"})  # what is delivered does not change the files
    text = json.dumps({"version": GENERATOR_VERSION, "spec": wanted}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_file(path: Path, file_format: str, rows: np.ndarray) -> None:
    if file_format == "raw":
        path.write_bytes(rows.tobytes())
    else:
        with open(path, "wb") as handle:
            np.savez(handle, x=rows, y=np.zeros(len(rows), dtype=np.uint8))


def ensure_records(spec: RecordSpec, cache_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """The synthetic record folder for `spec`, generated (file by file, seeded) if missing."""
    folder = cache_dir / "datasets"
    final = folder / f"records-{_key(spec)}"
    if final.exists():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=folder))
    try:
        honour_umask(tmp, folder=True)
        sizes = record_sizes(spec)
        suffix = RECORD_EXTENSIONS[spec.file_format]
        for number, size in enumerate(sizes.tolist()):
            rng = np.random.Generator(np.random.PCG64([spec.seed, number]))
            rows = rng.integers(0, 256, size=(spec.samples_per_file, size), dtype=np.uint8)
            _write_file(tmp / f"file-{number:07d}{suffix}", spec.file_format, rows)
            if progress is not None:
                progress(number + 1, len(sizes))
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _npz_rows(fs: fsspec.AbstractFileSystem, name: str) -> tuple[int, int]:
    """(records, bytes per record) of an npz record file, from its `x` array's header only."""
    with fs.open(name, "rb") as handle, np.load(handle) as archive:
        member = archive.zip.open("x.npy")
        version = np.lib.format.read_magic(member)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(member)
    if len(shape) == 3:  # DLIO's npz generator: (dim1, dim2, samples), a record being x[..., i]
        return int(shape[2]), int(shape[0]) * int(shape[1]) * np.dtype(dtype).itemsize
    if len(shape) != 2:
        raise DatasetError(f"{redact(name)}: not a record file of this layout (an `x` array of records, one per "
                           f"row, or DLIO's (dim1, dim2, samples); found shape {shape})")
    return int(shape[0]), int(shape[1]) * np.dtype(dtype).itemsize


def _list_records(fs: fsspec.AbstractFileSystem, root: str, path: str, spec: RecordSpec) -> SavedListing:
    """The record files of the folder, by name, with their sizes, modification times and fingerprint; an npz
    file's records and bytes per record too (its `x` array's header: a read each, kept with the listing)."""
    shown = redact(path)
    suffix = RECORD_EXTENSIONS[spec.file_format]
    with storage_errors(path, "list the record folder"):
        if not fs.isdir(root):
            raise DatasetError(f"{shown}: {why_missing(fs, root, path, 'record folder not found')}")
        infos = sorted((info for info in fs.find(root, detail=True).values() if info["name"].endswith(suffix)),
                       key=lambda info: info["name"])
        files = remote_listing.described(fs, infos)
    if not files:
        raise DatasetError(f"{shown}: no {suffix} record files found (dataset.records.file_format: "
                           f"{spec.file_format})")
    arrays = {}
    if spec.file_format == "npz":
        shapes = []
        for file in files:
            try:
                shapes.append(_npz_rows(fs, file.name))
            except DatasetError:
                raise
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
                raise DatasetError(f"{redact(file.name)}: not a readable npz record file ({exc})") from None
        arrays = {"rows": np.array([r for r, _ in shapes], dtype=np.int64),
                  "record_bytes": np.array([b for _, b in shapes], dtype=np.int64)}
    # Names, sizes and modification times: a file rewritten in place is another dataset. (The modification
    # time as this digest has always taken it: `mtime` or `LastModified`.)
    stamps = [str(i.get("mtime") or i.get("LastModified") or "") for i in infos]
    digest = hashlib.sha256(json.dumps([(fs.unstrip_protocol(f.name), f.size, m)
                                        for f, m in zip(files, stamps, strict=True)]).encode()).hexdigest()[:16]
    return remote_listing.listing_of(root, files, f"records-{digest}", arrays=arrays)


def open_records(path: str, spec: RecordSpec, storage_options: dict[str, Any] | None = None,
                 synthetic: bool = False, relist: bool = False) -> RecordDataset:
    """The records of the folder at `path` (a path or URL): `*.bin` files of `samples_per_file` records
    each, or `*.npz` files with an `x` array of records (one per row). A remote folder is listed once and
    its listing saved (`relist` lists it again)."""
    fs, root = open_url(path, storage_options)
    key = ListingKey.of("records", path, "", storage_options, spec.file_format)
    listing = remote_listing.remembered(fs, root, key, relist, lambda: _list_records(fs, root, path, spec))
    sizes = np.asarray(listing.sizes, dtype=np.int64)
    if spec.file_format == "raw":
        rows = np.full(len(sizes), spec.samples_per_file, dtype=np.int64)
        uneven = np.flatnonzero(sizes % spec.samples_per_file)
        if len(uneven):
            name = listing.files[uneven[0]].decode()
            raise DatasetError(f"{redact(name)}: {int(sizes[uneven[0]])} bytes is not {spec.samples_per_file} records "
                               "of one size (dataset.records.samples_per_file)")
        record = sizes // spec.samples_per_file
    else:
        rows, record = np.asarray(listing.arrays["rows"]), np.asarray(listing.arrays["record_bytes"])
    # Per sample, without a Python loop over the files (a million files open in well under a second).
    file_of = np.repeat(np.arange(len(sizes), dtype=np.int64), rows)
    row_of = np.arange(len(file_of), dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)
    starts = np.concatenate([[0], np.cumsum(np.broadcast_to(rows, len(sizes)))]).astype(np.int64)
    return RecordDataset(root=root, fs=fs, files=listing.files, file_bytes=sizes, file_of=file_of, row_of=row_of,
                         sizes=np.repeat(record, rows), file_format=spec.file_format,
                         delivered_bytes=spec.delivered_bytes, fingerprint=listing.fingerprint, synthetic=synthetic,
                         listed_at=listing.listed_at, shard_bounds=np.unique(starts))  # a file without records: none


def open_source(request: SourceRequest) -> RecordDataset:
    """The record files at `request.path`, or the synthetic ones the config describes, generated on first use."""
    from loadopt.storage.forms import integrity

    spec, path, progress = request.config.dataset.records, request.path, request.progress
    if path is not None:
        return open_records(path, spec, request.storage_options, relist=request.relist)
    try:
        folder = ensure_records(spec, cache_dir(), progress=progress)
    except OSError as exc:
        if is_no_space(exc):  # the partial folder is already gone (records.ensure_records)
            needed = int(record_sizes(spec).sum()) * spec.samples_per_file
            raise integrity.no_space_error(cache_dir() / "datasets", needed, "the synthetic records") from None
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic records into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    return open_records(str(folder), spec, synthetic=True)
