"""WebDataset tar shards as a dataset (`dataset.format: webdataset`): a folder of `.tar` shards or
WebDataset's brace notation (`shards/train-{000000..000127}.tar`), local or any fsspec URL.

A sample is the run of members sharing a key (WebDataset's rule: the member's name up to the first dot
of its base name); its image is the member with an image extension, its label the integer in its `cls`
member, or a field of its `json` member (`dataset.label_key`), kept as written (a label that is not a class
is a sample error: `class_numbers`). The index (shard, offset and length of each
sample's image) is built by reading the tar headers, seeking over member data (only the small label
members are read), and kept in the cache with the shards' fingerprint (names, sizes, modification
times): a second open reads no shard. A sample is then one byte-range read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import fsspec
import numpy as np

from loadopt.errors import DatasetError
from loadopt.files import cache_dir
from loadopt.imaging import jxl
from loadopt.storage.remote import listing as remote_listing
from loadopt.storage.remote.access import display_name, is_local_fs, open_url, redact, storage_errors, why_missing
from loadopt.storage.remote.listing import ListedFile, ListingKey, SavedListing
from loadopt.storage.remote.rebuilt_jpegs import RebuiltJpegs
from loadopt.storage.sources import manifest
from loadopt.storage.sources.format import (
    BRACE,
    GLOB_CHARS,
    LABEL_RULE,
    class_numbers,
    expand_braces,
    of_split,
    raise_if_compressed,
)
from loadopt.storage.sources.request import IndexThrough, SourceRequest
from loadopt.storage.sources.shards import ShardTable
from loadopt.storage.sources.tar_fields import FIELDS_RULE, field_arrays, field_value
from loadopt.storage.sources.tar_members import BLOCK, ShardSamples, index_shard, is_member_header

log = logging.getLogger(__name__)

INDEX_BLOCK_BYTES = 8 << 20  # a remote shard's reads while it is indexed
INDEX_STREAMS = 4  # remote shards indexed at once


@dataclass
class WebDataset:
    """The samples of one split of tar shards: each image's shard, offset and length, and its label."""

    root: str  # the shards' folder, as a path or URL
    fs: fsspec.AbstractFileSystem
    shards: np.ndarray  # fixed-width UTF-8 bytes, one per shard, as `fs` names them
    shard_of: np.ndarray  # int64, each sample's shard
    offsets: np.ndarray  # int64, where its image member's data starts in the shard
    keys: np.ndarray  # fixed-width UTF-8 bytes: each sample's key, for messages
    labels: np.ndarray  # int64
    sizes: np.ndarray  # int64, the image member's bytes
    classes: list[str]
    fingerprint: str
    left_out: list[str] = field(default_factory=list)  # samples without an image member or a class, empty shards
    synthetic: bool = False
    converted: str | None = None
    listed_at: float | None = None  # when its saved remote listing was taken
    shard_bounds: np.ndarray | None = None  # where each shard's samples start (then their count): its shard table
    file_keys: list[str] | None = None  # each shard's size, modification time and ETag, as listed
    field_index: dict[str, np.ndarray] = field(default_factory=dict)  # the small members' bytes (`field_arrays`)
    # Through a shard cache: the JPEGs of recompressed shards, rebuilt once per cache (made when first needed)
    rebuilt_jpegs: RebuiltJpegs | None = field(default=None, repr=False, compare=False)
    kind: ClassVar[str] = "images"
    source_format: ClassVar[str] = "webdataset"

    def __len__(self) -> int:
        return len(self.sizes)

    def path(self, index: int) -> str:
        start = int(self.offsets[index])
        return (f"{self.shards[self.shard_of[index]].decode()} (sample {self.keys[index].decode()}, "
                f"bytes {start}-{start + int(self.sizes[index])})")

    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def local_files(self) -> list[str]:
        return [s.decode() for s in self.shards] if self.is_local() else []

    def field_names(self, partial: bool = False) -> list[str]:
        """The member extensions every sample has besides its image and `cls` label (`txt`, `json`, ...);
        `partial`: also those only some have."""
        return [key[len("field-"):-len("-has")] for key, has in self.field_index.items()
                if key.endswith("-has") and (partial or bool(np.all(has)))]

    def fields(self, indices: np.ndarray, names: list[str]) -> dict[str, list]:
        out: dict[str, list] = {}
        for name in names:
            data, ends = self.field_index[f"field-{name}-data"], self.field_index[f"field-{name}-ends"]
            starts = np.concatenate([[0], ends[:-1]])
            out[name] = [field_value(name, bytes(data[starts[i] : ends[i]])) for i in indices.tolist()]
        return out

    def missing_fields(self, names: list[str]) -> dict[int, str]:
        missing: dict[int, str] = {}
        for name in names:
            has = self.field_index.get(f"field-{name}-has")
            if has is not None:
                for i in np.flatnonzero(~np.asarray(has)).tolist():
                    missing.setdefault(i, f"no `{name}` member (pipeline.fields names it)")
        return missing

    def read(self, index: int) -> bytes:
        """The image member's bytes (a recompressed JPEG's JPEG): one `pread` on a local disk,
        else one byte-range request."""
        shard = self.shards[self.shard_of[index]].decode()
        start, length = int(self.offsets[index]), int(self.sizes[index])
        rebuilt = self._rebuilt_jpegs()
        if rebuilt is not None and (known := rebuilt.known(shard, start)) is not None:
            return known
        if self.is_local():
            fd = os.open(shard, os.O_RDONLY)
            try:
                data = os.pread(fd, length, start)
            finally:
                os.close(fd)
        else:
            # The member's tar header comes along (512 bytes more in the same request): a shard rewritten on the
            # server since it was listed moves its members, and the header then says so instead of the bytes
            # being handed on as a damaged image.
            shown = display_name(self.fs, shard)
            data = remote_listing.read_listed(self.fs, shard, shown, self.listed_at, length + BLOCK, start - BLOCK,
                                              start + length)
            header, data = data[:BLOCK], data[BLOCK:]
            if not is_member_header(header, length):
                key = self.keys[index].decode()
                what = f"no tar header of a {length:,}-byte member at byte {start - BLOCK:,} (sample {key})"
                if self.listed_at is not None:
                    raise remote_listing.changed(shown, what, self.listed_at)
                raise DatasetError(f"{shown}: {what}")
        if len(data) != length:
            raise DatasetError(f"{redact(self.path(index))}: cut short ({len(data)} of {length} bytes)")
        if rebuilt is not None and jxl.is_jxl(data):
            shard_id = int(self.shard_of[index])
            made = rebuilt.rebuilt(shard, start, lambda: self._members(shard_id))
            if made is not None:
                return made
        return jxl.decodable(data)

    def _rebuilt_jpegs(self) -> RebuiltJpegs | None:
        """The rebuilt JPEGs of the shards read through a shard cache (None for shards read directly)."""
        if self.rebuilt_jpegs is None and not self.is_local() and RebuiltJpegs.applies(self.fs):
            self.rebuilt_jpegs = RebuiltJpegs(self.fs)
        return self.rebuilt_jpegs

    def _members(self, shard_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The offsets and lengths of shard `shard_id`'s image members."""
        mine = np.flatnonzero(self.shard_of == shard_id)
        return self.offsets[mine], self.sizes[mine]


def _reader(fs: fsspec.AbstractFileSystem, name: str) -> tuple[Callable[[int, int], bytes], Callable[[], None]]:
    """read(offset, size) over shard `name` and its closer: `pread` locally, seeks over an fsspec file."""
    if is_local_fs(fs):
        fd = os.open(name, os.O_RDONLY)
        return (lambda start, size: os.pread(fd, size, start)), (lambda: os.close(fd))
    # Headers sit between the members' data, so indexing reads the shard start to end; in large blocks: a
    # request a header (64 KiB blocks, one a ~110 KB photo) paid the store's latency a sample (60 s to the
    # first batch of 1,000 photos at 20 ms a request, benchmarks/webscale.py), 8 MiB blocks a few times a shard.
    handle = fs.open(name, "rb", block_size=INDEX_BLOCK_BYTES, cache_type="readahead")

    def read(start: int, size: int) -> bytes:
        handle.seek(start)
        return handle.read(size)

    return read, handle.close


def _shard_names(fs: fsspec.AbstractFileSystem, path: str, split: str, shown: str) -> tuple[str, list[str]]:
    """The shards' folder and the shard files of `split`: a brace pattern's names (another split's: the
    `<split>-*` shards beside them, where the pattern names train's), a glob's matches, a single shard, or a
    folder's `.tar` files of that split (or those of its `<split>/` folder)."""
    if BRACE.search(path):
        folder, _, pattern = path.rpartition("/")
        if split != "train" and pattern.startswith("train"):  # splits differ in shard counts: list theirs
            return folder, of_split([n for n in fs.ls(folder, detail=False) if n.endswith(".tar")], split, shown)
        return folder, [f"{folder}/{name}" if folder else name for name in expand_braces(pattern)]
    if any(c in path for c in GLOB_CHARS):
        return path.rpartition("/")[0], sorted(fs.glob(path))
    if path.endswith(".tar") and not fs.isdir(path):
        return path.rpartition("/")[0], [path]
    folder = path.rstrip("/")
    tars = sorted(n for n in fs.ls(folder, detail=False) if n.endswith(".tar"))
    inner = f"{folder}/{split}"
    if not tars and fs.isdir(inner):
        return inner, sorted(n for n in fs.ls(inner, detail=False) if n.endswith(".tar"))
    return folder, of_split(tars, split, shown)


def _shard_infos(fs: fsspec.AbstractFileSystem, folder: str, names: list[str], shown: str) -> list[ListedFile]:
    """Each shard's size, modification time and ETag: from one listing of their folder where it names them."""
    listed = {info["name"].rstrip("/"): info for info in fs.ls(folder, detail=True)} if folder else {}
    found = []
    for name in names:
        info = listed.get(fs._strip_protocol(name).rstrip("/")) or listed.get(name)
        if info is None or info.get("size") is None:
            if not fs.exists(name):
                raise DatasetError(f"{display_name(fs, name)}: shard not found (of {shown})")
            info = fs.info(name)
        found.append(ListedFile(name, int(info.get("size") or fs.size(name) or 0), remote_listing.modified(info),
                                remote_listing.etag(info)))
    return found


def _index_shards(fs: fsspec.AbstractFileSystem, names: list[str], sizes: list[int], label_key: str | None,
                  fingerprint: str) -> manifest.SampleIndex:
    """Read every shard's headers (and label members): the index the dataset is opened from."""
    shard_of, offsets, lengths, keys, labels, label_members, left_out = [], [], [], [], [], [], []
    fields: list[dict[str, bytes]] = []

    def one(name: str, total: int) -> ShardSamples | str:
        shown = display_name(fs, name)
        if total == 0:  # an upload that failed part way, or a writer killed before its first sample
            return f"{shown} (an empty file: 0 bytes, no tar header)"
        read, close = _reader(fs, name)
        try:
            return index_shard(read, total, shown, label_key)
        finally:
            close()

    # Remote shards are read start to end: a few at once keep the link full (one stream at a time paid a
    # request's latency per block and left it idle between shards); local ones are read one after another.
    with ThreadPoolExecutor(1 if is_local_fs(fs) else INDEX_STREAMS) as pool:
        indexed = list(pool.map(one, names, sizes))
    for number, found in enumerate(indexed):
        if isinstance(found, str):
            left_out.append(found)
            continue
        shard_of += [number] * len(found.sizes)
        offsets += found.offsets
        lengths += found.sizes
        keys += found.keys
        labels += found.labels
        label_members += found.label_members
        left_out += found.left_out
        fields += found.fields
    classes = class_numbers(labels, None)
    field_named = "" if label_key is None else f" field {label_key!r}"
    for i, why in classes.wrong.items():
        left_out.append(f"{display_name(fs, names[shard_of[i]])} (sample {keys[i]}, member {label_members[i]}"
                        f"{field_named}): {why}")
    kept = classes.numbers >= 0
    runs = np.array(shard_of, dtype=np.int64)[kept]
    # Where each shard's samples start: the window order's shard table, without reading `shard_of` whole (a
    # rank of a web-scale set maps the index and reads its own shards' rows only).
    bounds = ShardTable.from_runs(runs).bounds if len(runs) else np.zeros(1, np.int64)
    arrays = {"shard_of": runs, "shard_bounds": bounds, "offsets": np.array(offsets, dtype=np.int64)[kept],
              "sizes": np.array(lengths, dtype=np.int64)[kept], "labels": classes.numbers[kept],
              "keys": np.array([k.encode() for k in keys], dtype=np.bytes_)[kept],
              **field_arrays([f for f, keep in zip(fields, kept.tolist(), strict=True) if keep])}
    return manifest.SampleIndex(arrays=arrays, classes=classes.classes, fingerprint=fingerprint, notes=left_out)


def listing_key(path_url: str, split: str, storage_options: dict[str, Any] | None,
                label_key: str | None) -> ListingKey:
    """What names the saved listing of these shards (the label key is in their fingerprint)."""
    return ListingKey.of("webdataset", path_url, split, storage_options, f"{label_key or 'cls'}:{LABEL_RULE}")


def _identity(fs: fsspec.AbstractFileSystem, folder: str, split: str, label_key: str | None) -> str:
    return f"webdataset:{fs.unstrip_protocol(folder)}:{split}:{label_key or 'cls'}:{LABEL_RULE}:{FIELDS_RULE}"


def _list_shards(fs: fsspec.AbstractFileSystem, path: str, path_url: str, split: str,
                 label_key: str | None) -> SavedListing:
    """The shards of `split` at `path`, with their sizes, modification times and fingerprint."""
    shown = redact(path_url)
    with storage_errors(path_url, "list the shards"):
        if not BRACE.search(path) and not any(c in path for c in GLOB_CHARS) and not fs.exists(path):
            raise DatasetError(f"{shown}: {why_missing(fs, path, path_url, 'shards not found')}")
        folder, names = _shard_names(fs, path, split, shown)
        raise_if_compressed([display_name(fs, name) for name in names])
        if not names:
            listed = [] if BRACE.search(path) or any(c in path for c in GLOB_CHARS) else fs.ls(folder, detail=False)
            raise_if_compressed([display_name(fs, name) for name in listed])
            raise DatasetError(f"{shown}: no .tar shards found")
        files = _shard_infos(fs, folder, names, shown)
    fingerprint = manifest.fingerprint(_identity(fs, folder, split, label_key), [n.rsplit("/", 1)[-1] for n in names],
                                       [f.size for f in files], [f.mtime for f in files])
    return remote_listing.listing_of(folder, files, fingerprint)


def open_webdataset(path_url: str, split: str = "train", storage_options: dict[str, Any] | None = None,
                    label_key: str | None = None, on_error: str = "raise", relist: bool = False,
                    index_through: IndexThrough | None = None) -> WebDataset:
    """The `split` of the tar shards at `path_url` (a folder, a brace pattern, a glob or one shard): from
    the cached index while the shards' names, sizes and modification times are unchanged, else indexed.
    Remote shards are listed once and their listing saved (`relist` lists them
    again). A sample without an image member or whose label is not a class, or an empty shard, is an error,
    or under `on_error: skip` left out and named. `index_through(fs, fingerprint)` gives the filesystem the
    shards are indexed through (the bounded shard cache: indexing reads every shard whole, and its first
    epoch then reads the copies)."""
    fs, path = open_url(path_url, storage_options)
    shown = redact(path_url)
    listing = remote_listing.remembered(fs, path, listing_key(path_url, split, storage_options, label_key), relist,
                                        lambda: _list_shards(fs, path, path_url, split, label_key))
    folder, fingerprint = listing.root, listing.fingerprint
    root = fs.unstrip_protocol(folder) if not is_local_fs(fs) else folder
    identity = _identity(fs, folder, split, label_key)
    where = manifest.manifest_path(identity, cache_dir())
    index = manifest.load_index(where, identity, fingerprint)
    if index is None:
        with storage_errors(path_url, "read the shards' headers"):
            reads = index_through(fs, fingerprint) if index_through is not None else fs
            index = _index_shards(reads, listing.names(), listing.sizes.tolist(), label_key, fingerprint)
        manifest.save_index(where, index, identity)
    if index.notes and on_error != "skip":
        raise DatasetError(f"{index.notes[0]}; set dataset.on_error: skip to leave it out "
                           f"({len(index.notes)} such in all)")
    if index.notes:
        log.warning("%s: %d sample(s) without an image member or a class, or empty shard(s), left out; the first: "
                    "%s", shown, len(index.notes), index.notes[0])
    if not len(index.arrays["sizes"]):
        raise DatasetError(f"{shown}: no samples with an image member and a class in {len(listing.files)} "
                           "shard(s)")
    arrays = index.arrays
    return WebDataset(root=root, fs=fs, shards=listing.files, shard_of=arrays["shard_of"], offsets=arrays["offsets"],
                      keys=arrays["keys"], labels=arrays["labels"], sizes=arrays["sizes"], classes=index.classes,
                      fingerprint=fingerprint, left_out=index.notes, listed_at=listing.listed_at,
                      shard_bounds=arrays.get("shard_bounds"), file_keys=listing.file_keys(),
                      field_index={k: v for k, v in arrays.items() if k.startswith("field-")})


def open_source(request: SourceRequest) -> WebDataset:
    """The tar shards at `request.path`."""
    assert request.path is not None, "tar shards are opened where they are"
    spec = request.config.dataset
    return open_webdataset(request.path, request.split, request.storage_options, spec.label_key, spec.on_error,
                           request.relist, request.index_through)
