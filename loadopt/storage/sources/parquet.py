"""Parquet files as a dataset (`dataset.format: parquet`): a folder as downloaded from the Hugging Face hub
(`data/train-00000-of-00042.parquet`, the split from the file names), or a folder, list or glob of files.

The image column is a `{bytes, path}` struct, as Hugging Face `datasets` writes an `Image()` feature, or
plain binary; the label column integers (kept as written) or class-name strings, the class names taken from
the `huggingface` schema metadata where present (a ClassLabel feature), `dataset.columns` naming them. A row
whose label is not a class (a null, text among integers) or whose image is null or empty is a sample error:
named, and left out under `dataset.on_error: skip`. Row groups are the unit read: remote
files through `pyarrow.parquet.ParquetFile` over an fsspec file (byte ranges, never the whole file), the
last few decoded row groups kept so a batch's samples do not reread theirs. The index (file, row group,
row and stored bytes per sample) is kept in the cache with the files' fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loadopt.errors import DatasetError
from loadopt.files import cache_dir
from loadopt.imaging import jxl
from loadopt.storage.remote import listing as remote_listing
from loadopt.storage.remote.access import display_name, is_local_fs, open_url, redact, storage_errors, why_missing
from loadopt.storage.remote.listing import ListedFile, ListingKey, SavedListing
from loadopt.storage.sources import manifest
from loadopt.storage.sources.format import GLOB_CHARS, LABEL_RULE, class_numbers, of_split
from loadopt.storage.sources.request import SourceRequest
from loadopt.storage.sources.shards import ShardTable

log = logging.getLogger(__name__)

# Decoded row groups held per process, by their image bytes (the newest always kept). A random order meets
# a new row group at almost every sample once the split outgrows this: each then costs a whole row group's
# read and decompression (benchmarks/sources.py shows it); the converting backends read each sample alone.
ROW_GROUP_CACHE_BYTES = 512 << 20


@dataclass
class ParquetDataset:
    """The samples of one split of Parquet files: each sample's file, row group and row, label and size."""

    root: str
    fs: fsspec.AbstractFileSystem
    files: np.ndarray  # fixed-width UTF-8 bytes, one per file, as `fs` names them
    file_of: np.ndarray  # int64
    group_of: np.ndarray  # int64, the row group in its file
    row_of: np.ndarray  # int64, the row in its row group
    labels: np.ndarray  # int64
    sizes: np.ndarray  # int64, the image's stored bytes
    classes: list[str]
    fingerprint: str
    image_column: str = "image"
    label_column: str = "label"
    synthetic: bool = False
    converted: str | None = None
    left_out: list[str] = field(default_factory=list)  # samples indexing left out (on_error: skip), named
    file_bytes: np.ndarray | None = None  # int64, each file's size as listed
    listed_at: float | None = None  # when its saved remote listing was taken
    shard_bounds: np.ndarray | None = None  # where each file's samples start (then their count): its shard table
    file_keys: list[str] | None = None  # each file's size, modification time and ETag, as listed
    kind: ClassVar[str] = "images"
    source_format: ClassVar[str] = "parquet"
    row_groups: RowGroupCache = field(default_factory=lambda: RowGroupCache(), repr=False)
    # The files the consumer reads other columns from (`fields`), opened once (not shared with the readers' threads).
    field_files: dict[int, pq.ParquetFile] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.sizes)

    def path(self, index: int) -> str:
        return (f"{self.files[self.file_of[index]].decode()} (row group {int(self.group_of[index])}, "
                f"row {int(self.row_of[index])})")

    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def local_files(self) -> list[str]:
        return [f.decode() for f in self.files] if self.is_local() else []

    def read(self, index: int) -> bytes:
        """The image's stored bytes (a recompressed JPEG's JPEG), from its row group (read once
        while among the last few used)."""
        images = self.row_groups.images(self, int(self.file_of[index]), int(self.group_of[index]))
        value = images[int(self.row_of[index])].as_py()
        if not value:  # indexing leaves such rows out; a file rewritten since must not pass one to a decoder
            raise DatasetError(f"{redact(self.path(index))}: no image bytes ({'null' if value is None else 'empty'})")
        return jxl.decodable(value)

    def open_file(self, file: int) -> pq.ParquetFile:
        """File `file`, opened for reading (a remote one checked against its listing)."""
        name = self.files[file].decode()
        expected = int(self.file_bytes[file]) if self.file_bytes is not None else None
        return pq.ParquetFile(name if self.is_local() else
                              remote_listing.open_listed(self.fs, name, display_name(self.fs, name), self.listed_at,
                                                         expected))

    def field_names(self, partial: bool = False) -> list[str]:
        """The columns besides the image and label (of the first file's schema)."""
        if 0 not in self.field_files:
            self.field_files[0] = self.open_file(0)
        return [name for name in self.field_files[0].schema_arrow.names
                if name not in (self.image_column, self.label_column)]

    def fields(self, indices: np.ndarray, names: list[str]) -> dict[str, list]:
        """Columns `names` of the samples, read from their row groups (those columns only), in the samples' order."""
        out: dict[str, list] = {name: [None] * len(indices) for name in names}
        tables: dict[tuple[int, int], pa.Table] = {}
        for k, index in enumerate(indices.tolist()):
            file, group = int(self.file_of[index]), int(self.group_of[index])
            table = tables.get((file, group))
            if table is None:
                if file not in self.field_files:
                    self.field_files[file] = self.open_file(file)
                try:
                    table = tables[(file, group)] = self.field_files[file].read_row_group(group, columns=names)
                except (OSError, pa.ArrowException, KeyError) as exc:
                    raise DatasetError(f"{redact(self.files[file].decode())}: cannot read columns {names} of row "
                                       f"group {group} ({exc})") from None
            row = int(self.row_of[index])
            for name in names:
                out[name][k] = table.column(name)[row].as_py()
        return out

    def missing_fields(self, names: list[str]) -> dict[int, str]:
        return {}  # a column every file has (its schema's); a null cell is None in the batch

    def read_group(self, file: int, group: int, handle: pq.ParquetFile | None) -> tuple[pa.Array, pq.ParquetFile]:
        """The image bytes of one row group, and the file opened to read it (`handle`, or opened now)."""
        name = self.files[file].decode()
        if handle is None:
            handle = self.open_file(file)
        try:
            table = handle.read_row_group(group, columns=[self.image_column])
        except (OSError, pa.ArrowException) as exc:
            raise DatasetError(f"{redact(name)}: cannot read row group {group} ({exc})") from None
        return image_bytes(table, self.image_column, name), handle


class RowGroupCache:
    """The last few decoded row groups and the open files of one process (a pickled copy starts empty:
    open files and decoded data stay in the process that made them); `ROW_GROUP_CACHE_BYTES` of them.

    A `ParquetFile` is not safe to read from two threads at once (Arrow aborts the process), so each
    thread keeps its own open files; a row group two threads want at once is read by one of them."""

    def __init__(self) -> None:
        self.groups: OrderedDict[tuple[int, int], pa.Array] = OrderedDict()
        self.held = 0  # bytes of the groups held
        self.reading: dict[tuple[int, int], threading.Lock] = {}
        self.lock = threading.Lock()
        self.per_thread = threading.local()

    def __reduce__(self) -> tuple[type[RowGroupCache], tuple[()]]:
        return RowGroupCache, ()

    def kept(self, key: tuple[int, int]) -> pa.Array | None:
        with self.lock:
            images = self.groups.get(key)
            if images is not None:
                self.groups.move_to_end(key)
            return images

    def images(self, dataset: ParquetDataset, file: int, group: int) -> pa.Array:
        key = (file, group)
        images = self.kept(key)
        if images is not None:
            return images
        with self.lock:
            reading = self.reading.setdefault(key, threading.Lock())
        with reading:
            images = self.kept(key)
            if images is not None:
                return images
            handles: dict[int, pq.ParquetFile] = self.per_thread.__dict__.setdefault("handles", {})
            images, handles[file] = dataset.read_group(file, group, handles.get(file))
            with self.lock:
                self.groups[key] = images
                self.held += images.nbytes
                self.reading.pop(key, None)
                while self.held > ROW_GROUP_CACHE_BYTES and len(self.groups) > 1:
                    self.held -= self.groups.popitem(last=False)[1].nbytes
        return images


def image_bytes(table: pa.Table, column: str, where: str, referenced: bool = True) -> pa.Array:
    """The image column's bytes: the `bytes` field of Hugging Face's `{bytes, path}` struct, or the column. A cell
    with no bytes but a `path` (what `datasets`' `to_parquet` writes for images it loaded from local files) is that
    file's bytes where it is on this machine (`referenced`; else left null)."""
    if column not in table.column_names:
        raise DatasetError(f"{redact(where)}: no column {column!r} (columns: {', '.join(table.column_names)}); "
                           "set dataset.columns.image")
    cells = table.column(column).combine_chunks()
    values = cells
    if pa.types.is_struct(cells.type):
        if cells.type.get_field_index("bytes") < 0:
            raise DatasetError(f"{redact(where)}: column {column!r} is a struct without a `bytes` field")
        values = pc.struct_field(cells, "bytes")  # a null struct's cell null too (`.field` gives its child's bytes)
    if not (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type)):
        raise DatasetError(f"{redact(where)}: column {column!r} holds {values.type}, not image bytes")
    if referenced and values.null_count:
        files = referenced_files(cells, where)
        if any(files):
            data = [cell if cell is not None or not file else Path(file).read_bytes()
                    for cell, file in zip(values.to_pylist(), files, strict=True)]
            values = pa.array(data, type=values.type)
    return values


def referenced_files(cells: pa.Array, where: str) -> list[str | None]:
    """Per cell without bytes, the local file its `path` names (absolute, or beside the Parquet file `where`) where
    it is one; None for the others."""
    if not pa.types.is_struct(cells.type) or cells.type.get_field_index("path") < 0:
        return [None] * len(cells)
    stored = pc.struct_field(cells, "bytes").is_null().to_pylist()
    beside = Path(where).parent if "://" not in where else None
    out: list[str | None] = []
    for missing, path in zip(stored, pc.struct_field(cells, "path").to_pylist(), strict=True):
        found = None
        if missing and path:
            candidate = Path(path) if Path(path).is_absolute() or beside is None else beside / path
            found = str(candidate) if candidate.is_file() else None
        out.append(found)
    return out


def referenced_identity(fingerprint: str, file_keys: list[str], file_of: np.ndarray,
                        files: np.ndarray) -> tuple[str, list[str]]:
    """`fingerprint` and each Parquet file's key (what an incremental conversion reuses a shard by) with the size and
    modification time of each image file its cells name folded in (a stat each, as an ImageFolder's cold open
    does): a changed image is never served from a stale conversion."""
    per_file: dict[int, Any] = {}
    for number, name in zip(file_of.tolist(), files.tolist(), strict=True):
        if name:
            digest = per_file.setdefault(number, hashlib.sha256())
            try:
                stat = os.stat(name)
                digest.update(name + f"\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
            except OSError:
                digest.update(name + b"\0gone\0")
    stamps = {number: digest.hexdigest()[:16] for number, digest in per_file.items()}
    whole = hashlib.sha256((fingerprint + "".join(f"{n}:{d}" for n, d in sorted(stamps.items()))).encode())
    keys = [key + (f":images {stamps[n]}" if n in stamps else "") for n, key in enumerate(file_keys)]
    return whole.hexdigest()[:16], keys


def class_names(schema: pa.Schema, label: str) -> list[str] | None:
    """The label's class names from the `huggingface` schema metadata (a ClassLabel feature), else None."""
    try:
        info = json.loads((schema.metadata or {})[b"huggingface"])
        names = info["info"]["features"][label]["names"]
    except (KeyError, TypeError, ValueError):
        return None
    return [str(n) for n in names] if isinstance(names, list) else None


def parquet_files(fs: fsspec.AbstractFileSystem, path: str | list[str], split: str,
                  shown: str) -> tuple[str, list[str]]:
    """The files' folder and the Parquet files of `split`: a list as given, a glob's matches, one file, or
    a folder's `*.parquet` (a Hugging Face folder's `data/` ones) of that split."""
    if isinstance(path, list):
        return path[0].rpartition("/")[0], list(path)
    if any(c in path for c in GLOB_CHARS):
        return path.rpartition("/")[0], sorted(fs.glob(path))
    if path.endswith(".parquet") and not fs.isdir(path):
        return path.rpartition("/")[0], [path]
    folder = path.rstrip("/")
    for inner in (folder, f"{folder}/data", f"{folder}/{split}"):
        if fs.isdir(inner):
            files = sorted(n for n in fs.ls(inner, detail=False) if n.endswith(".parquet"))
            if files:
                return inner, files if inner.endswith(f"/{split}") else of_split(files, split, shown)
    raise DatasetError(f"{shown}: no .parquet files (looked in it, its data/ and its {split}/)")


def _index_files(fs: fsspec.AbstractFileSystem, names: list[str], columns: tuple[str, str],
                 fingerprint: str) -> manifest.SampleIndex:
    """Read each file's label column and image sizes, row group by row group; rows without image bytes or a
    class are named in the notes and left out of the arrays."""
    image, label = columns
    file_of, group_of, row_of, sizes, labels, missing, file_rows = [], [], [], [], [], [], []
    referenced: list[bytes] = []  # per row, the local file its image is read from ("" where the bytes are stored)
    names_found: list[str] | None = None
    first_schema: pa.Schema | None = None
    for number, name in enumerate(names):
        with fs.open(name, "rb") as handle:
            try:
                parquet = pq.ParquetFile(handle)
            except pa.ArrowInvalid as exc:  # a damaged footer: the file, not its folder, is the culprit
                raise DatasetError(f"{display_name(fs, name)}: not a readable Parquet file ({exc})") from None
            schema = parquet.schema_arrow
            for column in columns:
                if column not in schema.names:
                    raise DatasetError(f"{display_name(fs, name)}: no column {column!r} (columns: "
                                       f"{', '.join(schema.names)}); set dataset.columns")
            if first_schema is None:
                first_schema, names_found = schema, class_names(schema, label)
            elif not schema.remove_metadata().equals(first_schema.remove_metadata()):
                raise DatasetError(f"{display_name(fs, name)}: its schema differs from "
                                   f"{display_name(fs, names[0])}'s")
            rows_before = 0
            for group in range(parquet.num_row_groups):
                table = parquet.read_row_group(group, columns=[image, label])
                images = image_bytes(table, image, name, referenced=False)
                lengths = pc.binary_length(images).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                for row, file in enumerate(referenced_files(table.column(image).combine_chunks(), name)):
                    if file is not None:  # read from the file its path names (`image_bytes`): its size
                        lengths[row] = os.path.getsize(file)
                    referenced.append((file or "").encode())
                sizes.append(lengths.astype(np.int64))
                missing.append(images.is_null().to_numpy(zero_copy_only=False))
                labels += table.column(label).to_pylist()
                file_of.append(np.full(len(lengths), number, dtype=np.int64))
                group_of.append(np.full(len(lengths), group, dtype=np.int64))
                row_of.append(np.arange(len(lengths), dtype=np.int64))
                file_rows.append(np.arange(rows_before, rows_before + len(lengths), dtype=np.int64))
                rows_before += len(lengths)
    empty = np.array([], dtype=np.int64)
    every_file = np.concatenate(file_of or [empty])
    every_size = np.concatenate(sizes or [empty])
    null_image = np.concatenate(missing or [np.array([], dtype=bool)])
    row_in_file = np.concatenate(file_rows or [empty])
    classes = class_numbers(labels, names_found)
    notes = []
    for i in np.flatnonzero((every_size == 0) | (classes.numbers < 0)).tolist():
        why = (f"no image bytes ({'null' if null_image[i] else 'empty'})" if every_size[i] == 0 else
               classes.wrong[i])
        notes.append(f"{display_name(fs, names[every_file[i]])} (row {row_in_file[i]}): {why}")
    kept = (every_size > 0) & (classes.numbers >= 0)
    runs = every_file[kept]
    # the window order's shard table, kept so that a rank need not read `file_of` whole
    bounds = ShardTable.from_runs(runs).bounds if len(runs) else np.zeros(1, np.int64)
    arrays = {"file_of": runs, "shard_bounds": bounds, "group_of": np.concatenate(group_of or [empty])[kept],
              "row_of": np.concatenate(row_of or [empty])[kept], "sizes": every_size[kept],
              "labels": classes.numbers[kept]}
    if any(referenced):  # images read from the files their paths name: those files are part of the identity
        arrays["referenced"] = np.array(referenced, dtype=np.bytes_)[kept]
    return manifest.SampleIndex(arrays=arrays, classes=classes.classes, fingerprint=fingerprint, notes=notes)


def listing_key(path_url: str | list[str], split: str, storage_options: dict[str, Any] | None, image_column: str,
                label_column: str) -> ListingKey:
    """What names the saved listing of these files (the columns are in their fingerprint)."""
    return ListingKey.of("parquet", path_url, split, storage_options, f"{image_column}:{label_column}:{LABEL_RULE}")


def _identity(fs: fsspec.AbstractFileSystem, folder: str, split: str, columns: tuple[str, str]) -> str:
    return f"parquet:{fs.unstrip_protocol(folder)}:{split}:{columns[0]}:{columns[1]}:{LABEL_RULE}"


def _list_files(fs: fsspec.AbstractFileSystem, path: str, paths: str | list[str], first: str, split: str,
                columns: tuple[str, str]) -> SavedListing:
    """The Parquet files of `split`, with their sizes, modification times and fingerprint (a stat each)."""
    shown = redact(first)
    with storage_errors(first, "list the Parquet files"):
        if not isinstance(paths, list) and not any(c in path for c in GLOB_CHARS) and not fs.exists(path):
            raise DatasetError(f"{shown}: {why_missing(fs, path, first, 'Parquet files not found')}")
        folder, names = parquet_files(fs, paths, split, shown)
        if not names:
            raise DatasetError(f"{shown}: no .parquet files found")
        infos = [fs.info(name) for name in names]
    files = [ListedFile(name, int(i.get("size") or 0), remote_listing.modified(i), remote_listing.etag(i))
             for name, i in zip(names, infos, strict=True)]
    fingerprint = manifest.fingerprint(_identity(fs, folder, split, columns), [n.rsplit("/", 1)[-1] for n in names],
                                       [f.size for f in files], [f.mtime for f in files])
    return remote_listing.listing_of(folder, files, fingerprint)


def open_parquet(path_url: str | list[str], split: str = "train", storage_options: dict[str, Any] | None = None,
                 image_column: str = "image", label_column: str = "label", relist: bool = False,
                 on_error: str = "raise") -> ParquetDataset:
    """The `split` of the Parquet files at `path_url`: from the cached index while the files' names, sizes
    and modification times are unchanged, else indexed. Remote files are listed once and their listing
    saved (`relist` lists them again). A row without image bytes or a class is an
    error, or under `on_error: skip` left out and named."""
    first = path_url[0] if isinstance(path_url, list) else path_url
    fs, path = open_url(first, storage_options)
    paths: str | list[str] = [open_url(p, storage_options)[1] for p in path_url] if isinstance(path_url, list) else path
    shown = redact(first)
    columns = (image_column, label_column)
    listing = remote_listing.remembered(fs, path, listing_key(path_url, split, storage_options, *columns), relist,
                                        lambda: _list_files(fs, path, paths, first, split, columns))
    folder, fingerprint = listing.root, listing.fingerprint
    identity = _identity(fs, folder, split, columns)
    where = manifest.manifest_path(identity, cache_dir())
    index = manifest.load_index(where, identity, fingerprint)
    if index is None:
        with storage_errors(first, "read the Parquet files"):
            index = _index_files(fs, listing.names(), columns, fingerprint)
        manifest.save_index(where, index, identity)
    if index.notes and on_error != "skip":
        raise DatasetError(f"{index.notes[0]}; set dataset.on_error: skip to leave it out "
                           f"({len(index.notes)} such in all)")
    if index.notes:
        log.warning("%s: %d row(s) without image bytes or a class left out; the first: %s", shown,
                    len(index.notes), index.notes[0])
    if not len(index.arrays["sizes"]):
        raise DatasetError(f"{shown}: no rows with image bytes and a class in {len(listing.files)} Parquet file(s)")
    arrays = index.arrays
    file_keys = listing.file_keys()
    if "referenced" in arrays:  # images in files the cells name: their sizes and times are part of the identity
        fingerprint, file_keys = referenced_identity(fingerprint, file_keys, arrays["file_of"], arrays["referenced"])
    return ParquetDataset(root=fs.unstrip_protocol(folder) if not is_local_fs(fs) else folder, fs=fs,
                          files=listing.files, file_of=arrays["file_of"], group_of=arrays["group_of"],
                          row_of=arrays["row_of"], labels=arrays["labels"], sizes=arrays["sizes"],
                          classes=index.classes, fingerprint=fingerprint, image_column=image_column,
                          label_column=label_column, file_bytes=listing.sizes, listed_at=listing.listed_at,
                          shard_bounds=arrays.get("shard_bounds"), file_keys=file_keys, left_out=index.notes)


def open_source(request: SourceRequest) -> ParquetDataset:
    """The Parquet files at `request.path`."""
    assert request.path is not None, "Parquet files are opened where they are"
    spec = request.config.dataset
    return open_parquet(request.path, request.split, request.storage_options, spec.columns.image, spec.columns.label,
                        request.relist, spec.on_error)
