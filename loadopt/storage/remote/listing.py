"""The saved listing of a remote dataset: listed on its first open, read on every later one.

Listing a dataset on an object store or an HTTP server costs a request per page of names (S3's
ListObjectsV2 gives 1,000 keys a page) and a HEAD per file where the listing carries no sizes (HTTP index
pages): at a billion samples about 1M requests, minutes, on every open. An object store has no folder
modification time that would tell that nothing changed (what the local ImageFolder's manifest checks),
so the listing is kept until asked to refresh: the first open lists and saves it under
`<cache>/listings/<key>/`, and every later open reads it and sends no list or stat request. Saved:
the files as the filesystem names them, their sizes, each one's modification time and ETag as the store
gives them ("" where it gives none), what the source format derives from them (an ImageFolder's classes
and labels, an npz record folder's rows per file), the folder they are under, the fingerprint and when it
was listed. The per-file arrays are `.npy` (memory-mapped: a 1M-file listing opens in milliseconds, one
copy in the page cache for every process), the rest `meta.json`; written in a temporary folder renamed
into place (`manifest.write_arrays`).

The key: the source format, the URL as given (credentials redacted), the split, what else the saved
fingerprint depends on (a label key, the columns) and what selects the endpoint (`endpoint_url` in the
storage options, else `AWS_ENDPOINT_URL`), never a secret: the same bucket name on another endpoint is
another dataset, a rotated key is the same one.

`relist` (`--relist`) lists again and replaces the saved listing. What the store says of each file is the
dataset's identity: its ETag where it gives one, else its size and modification time (over HTTP a HEAD's
Last-Modified), all in the fingerprint (`with_etags`); so a file rewritten on the store and listed again has its
tar or Parquet index taken again, its copy in the shard cache not read, and its conversions redone. A file
that vanished or changed since is met when read (not found, fewer bytes, another size): `DatasetChanged`, one
line naming the file, when the listing was taken and `--relist`. Not saved: local folders (listed as before; a
local ImageFolder by its own manifest), `memory://` (in-process: nothing outlives it) and locations whose paths
carry credentials (`https://user:password@host/...`: the listing would write them into the cache), all listed
on every open.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from loadopt.errors import DatasetChanged
from loadopt.files import cache_dir
from loadopt.storage.remote.access import (
    TRANSIENT_STATUSES,
    RetryPolicy,
    display_name,
    http_status,
    is_local_fs,
    is_transient,
    read_with_retries,
    redact,
    why_unreachable,
)
from loadopt.storage.sources import manifest

LISTING_VERSION = 2  # 2: ETags in the fingerprint, an HTTP HEAD's Last-Modified as the modification time
FOLDER = "listings"
# Storage options that choose which server answers (at any depth: s3fs nests them in client_kwargs).
ENDPOINT_OPTIONS = ("endpoint_url", "endpoint", "account_name", "account_url", "host", "port")
# Where the options name no endpoint, the environment variables that do, per URL scheme (botocore and gcsfs read them).
ENDPOINT_ENVIRONMENT = {"s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"), "s3a": ("AWS_ENDPOINT_URL_S3",
                        "AWS_ENDPOINT_URL"), "gs": ("STORAGE_EMULATOR_HOST",), "gcs": ("STORAGE_EMULATOR_HOST",)}
_PER_FILE = ("files", "sizes", "mtimes", "etags")
RELIST_HINT = "rerun with --relist to list it again"


def endpoint(url: str, storage_options: dict[str, Any] | None) -> dict[str, str]:
    """What selects the server `url` is read from, beyond the URL itself (credentials redacted)."""
    found: dict[str, str] = {}

    def walk(options: dict[str, Any]) -> None:
        for name, value in options.items():
            if isinstance(value, dict):
                walk(value)
            elif name in ENDPOINT_OPTIONS and value not in (None, ""):
                found[name] = redact(str(value))

    walk(dict(storage_options or {}))
    if not found:
        for variable in ENDPOINT_ENVIRONMENT.get(url.split("://", 1)[0] if "://" in url else "", ()):
            if os.environ.get(variable):
                found[variable] = redact(os.environ[variable])
    return found


@dataclass(frozen=True)
class ListingKey:
    """What names a saved listing (its folder is a digest of it)."""

    source_format: str  # imagefolder | webdataset | parquet | records
    location: str  # the URL (or URLs) as given, credentials redacted
    split: str
    endpoint: str  # `endpoint(...)` as JSON
    detail: str = ""  # what else the saved fingerprint depends on (a label key, the columns, a file format)

    @classmethod
    def of(cls, source_format: str, location: str | list[str], split: str,
           storage_options: dict[str, Any] | None, detail: str = "") -> ListingKey:
        urls = location if isinstance(location, list) else [location]
        shown = json.dumps([redact(u) for u in urls]) if isinstance(location, list) else redact(location)
        return cls(source_format, shown, split, json.dumps(endpoint(urls[0], storage_options), sort_keys=True),
                   detail)

    def identity(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def path(self, cache: Path) -> Path:
        return cache / FOLDER / hashlib.sha256(self.identity().encode()).hexdigest()[:24]


@dataclass
class ListedFile:
    """One file as a listing gives it."""

    name: str  # as the filesystem names it
    size: int
    mtime: str  # its modification time as the listing gives it ("" where none: an HTTP index page)
    etag: str  # its ETag as the store gives it ("" where none)


@dataclass
class SavedListing:
    """A dataset's files as listed, and what its source format derived from them."""

    root: str  # the folder the files are under (the split folder, the shards' folder), as the filesystem names it
    files: np.ndarray  # fixed-width UTF-8 bytes, in the source's order
    sizes: np.ndarray  # int64
    mtimes: np.ndarray  # fixed-width UTF-8 bytes
    etags: np.ndarray  # fixed-width UTF-8 bytes
    fingerprint: str  # the source format's, as a listing at this open would give it
    classes: list[str] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # derived per file or sample: labels, rows, ...
    # When it was listed (seconds since the epoch); None for a listing that is not saved (taken at every open).
    listed_at: float | None = None
    cached: bool = False  # read from the cache: no request was made

    def names(self) -> list[str]:
        return [name.decode() for name in self.files]

    def file_keys(self) -> list[str]:
        """Each file's size, modification time and ETag: what says it changed (a conversion's shards of it are
        redone)."""
        return [f"{size}:{mtime.decode()}:{etag.decode()}"
                for size, mtime, etag in zip(self.sizes.tolist(), self.mtimes, self.etags, strict=True)]


def listing_of(root: str, files: list[ListedFile], fingerprint: str, classes: list[str] | None = None,
               arrays: dict[str, np.ndarray] | None = None) -> SavedListing:
    """A listing taken now, of `files` in the order the source reads them. Where the store gives ETags, they are
    part of its fingerprint (`with_etags`)."""
    fingerprint = with_etags(fingerprint, files)
    return SavedListing(root=root, files=_text([f.name for f in files]),
                        sizes=np.array([f.size for f in files], dtype=np.int64), mtimes=_text([f.mtime for f in files]),
                        etags=_text([f.etag for f in files]), fingerprint=fingerprint, classes=list(classes or []),
                        arrays=dict(arrays or {}), listed_at=time.time())


def with_etags(fingerprint: str, files: list[ListedFile]) -> str:
    """`fingerprint` (a source's digest of its files' names, sizes and modification times) with the files' ETags
    folded in where the store gives any: an object rewritten with the same size (and, over HTTP, a Last-Modified
    of the same second) is another object, whose index, cached copy and conversions are not reused."""
    if not any(f.etag for f in files):
        return fingerprint
    digest = hashlib.sha256(json.dumps([f.etag for f in files]).encode()).hexdigest()[:16]
    return f"{fingerprint}-etag{digest}"


def _text(values: list[str]) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.bytes_) if values else np.array([], dtype="S1")


def modified(info: dict[str, Any]) -> str:
    """A file's modification time as its filesystem lists it (local disks and object stores, an HTTP HEAD's
    Last-Modified; "" where the listing has none, as plain HTTP directory listings)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "Last-Modified"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def etag(info: dict[str, Any]) -> str:
    """A file's ETag as its store gives it (S3, GCS, Azure, an HTTP HEAD); "" where none."""
    return str(info.get("ETag") or info.get("etag") or "")


def described(fs: fsspec.AbstractFileSystem, infos: list[dict[str, Any]]) -> list[ListedFile]:
    """Each listed file (`infos`: entries of `fs.find`/`fs.ls` with details) with its size: HTTP directory
    listings carry none, so those are asked for (a HEAD each, 16 in flight, which also gives the ETag and
    Last-Modified: the modification time where the listing has none)."""
    missing = [info["name"] for info in infos if info.get("size") is None]
    headed: dict[str, dict[str, Any]] = {}
    if missing:
        with ThreadPoolExecutor(16) as pool:  # one round trip each: overlap them
            headed = dict(zip(missing, pool.map(fs.info, missing), strict=True))
    found = []
    for info in infos:
        more = headed.get(info["name"], {})
        size = info.get("size") if info.get("size") is not None else more.get("size")
        found.append(ListedFile(info["name"], int(size or 0), modified(info) or modified(more),
                                etag(info) or etag(more)))
    return found


def saves_listing(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether a listing of `path` on `fs` is kept: remote storage whose paths carry no credentials."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return not is_local_fs(fs) and "memory" not in protocols and redact(path) == path


def remembered(fs: fsspec.AbstractFileSystem, path: str, key: ListingKey, relist: bool,
               list_now: Callable[[], SavedListing]) -> SavedListing:
    """The listing of the dataset at `path`: the saved one (unless `relist`), else `list_now()`'s, saved.
    Where listings are not kept (`saves_listing`), `list_now()`'s at every open. Before a remote store is
    listed, it is asked once whether it answers (`answering`)."""
    if not saves_listing(fs, path):
        answering(fs, path, key)
        listing = list_now()
        listing.listed_at = None
        return listing
    where = key.path(cache_dir())
    if not relist:
        found = load(where, key)
        if found is not None:
            return found
    answering(fs, path, key)
    listing = list_now()
    save(where, listing, key)
    return listing


def answering(fs: fsspec.AbstractFileSystem, path: str, key: ListingKey,
              policy: RetryPolicy | None = None) -> None:
    """Wait, as reads are retried (`policy`, default `RetryPolicy()`), for a remote store that does not answer yet
    (a 503 with its Retry-After, a refused or dropped connection, a timeout): a listing taken then reads a busy
    server as an empty or missing dataset ("not found" is what fsspec's HTTP driver makes of a 503). A store
    that keeps not answering is a `StorageError` naming what it did; any other answer (not found, no
    credentials) is left for the listing to say in its own words. Nothing is asked of a local folder."""
    if is_local_fs(fs):
        return
    head = path
    for mark in ("{", "*", "?", "["):  # a brace or glob pattern: its folder is what answers
        if mark in head:
            head = head.split(mark, 1)[0].rpartition("/")[0]

    shown = key.location if not key.location.startswith("[") else display_name(fs, head)

    def ask() -> None:
        try:
            fs.info(head)
        except Exception as exc:  # noqa: BLE001 - only a busy or unreachable store is waited for
            status = http_status(exc)
            if status is not None and (status[0] >= 500 or status[0] in TRANSIENT_STATUSES):
                # fsspec's HTTP driver says a 503 as FileNotFoundError: the answer behind it is what counts
                raise ConnectionError(f"the server answered {status[0]}") from exc
            if status is None and (is_transient(exc) or why_unreachable(shown, exc) is not None):
                # a refused or dropped connection, a timeout (fsspec's HTTP driver says these as not found too)
                raise ConnectionError("the store did not answer") from exc
    read_with_retries(ask, policy or RetryPolicy(), shown)


def save(where: Path, listing: SavedListing, key: ListingKey) -> bool:
    """Write the listing's folder (best effort: a cache that cannot be written costs the next open a listing)."""
    meta = {"version": LISTING_VERSION, "identity": key.identity(), "root": listing.root,
            "fingerprint": listing.fingerprint, "classes": listing.classes, "listed_at": listing.listed_at,
            "arrays": sorted(listing.arrays), "files": len(listing.files)}
    arrays = {"files": listing.files, "sizes": listing.sizes, "mtimes": listing.mtimes, "etags": listing.etags,
              **{f"derived-{name}": array for name, array in listing.arrays.items()}}
    return manifest.write_arrays(where, arrays, meta, "remote listing")


def load(where: Path, key: ListingKey) -> SavedListing | None:
    """The listing saved at `where` for `key` (arrays memory-mapped read-only), else None."""
    try:
        meta = json.loads((where / manifest.META).read_text())
        if meta.get("version") != LISTING_VERSION or meta.get("identity") != key.identity():
            return None
        per_file = {name: np.load(where / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in _PER_FILE}
        if any(len(array) != meta["files"] for array in per_file.values()):
            return None
        arrays = {name: np.load(where / f"derived-{name}.npy", mmap_mode="r", allow_pickle=False)
                  for name in meta["arrays"]}
        return SavedListing(root=str(meta["root"]), files=per_file["files"], sizes=per_file["sizes"],
                            mtimes=per_file["mtimes"], etags=per_file["etags"], fingerprint=str(meta["fingerprint"]),
                            classes=list(meta["classes"]), arrays=arrays, listed_at=float(meta["listed_at"]),
                            cached=True)
    except (OSError, ValueError, KeyError, TypeError):  # missing, damaged, of another layout: list again
        return None


def is_saved(key: ListingKey) -> bool:
    """Whether a listing is saved for `key` (its meta read, no array; no request)."""
    try:
        meta = json.loads((key.path(cache_dir()) / manifest.META).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("version") == LISTING_VERSION and meta.get("identity") == key.identity()


# ---------------------------------------------------------------------------------------------
# Reads of listed files: one that vanished or changed since is said as such


def when(listed_at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(listed_at))


def changed(shown: str, what: str, listed_at: float) -> DatasetChanged:
    """The one line for file `shown` found `what` ("not found", "N bytes where the listing said M")."""
    return DatasetChanged(shown, f"{what}: the dataset changed since it was listed ({when(listed_at)}); {RELIST_HINT}")


def read_listed(fs: fsspec.AbstractFileSystem, name: str, shown: str, listed_at: float | None,
                expected: int | None = None, start: int | None = None, end: int | None = None) -> bytes:
    """`fs.cat_file(name, start, end)`. Under a saved listing (`listed_at`), a file not found, or a read of
    other than the `expected` bytes the listing gives it (None or 0: not known), is a `DatasetChanged`."""
    try:
        data = fs.cat_file(name, start=start, end=end)
    except FileNotFoundError:
        if listed_at is None:
            raise
        raise changed(shown, "not found", listed_at) from None
    if listed_at is not None and expected and len(data) != expected:
        raise changed(shown, f"{len(data):,} bytes read where the listing said {expected:,}", listed_at)
    return data


def open_listed(fs: fsspec.AbstractFileSystem, name: str, shown: str, listed_at: float | None,
                expected: int | None = None) -> Any:
    """`fs.open(name, "rb")`. Under a saved listing, a file not found or of another size than the
    `expected` one (None or 0: not known) is a `DatasetChanged`."""
    try:
        handle = fs.open(name, "rb")
    except FileNotFoundError:
        if listed_at is None:
            raise
        raise changed(shown, "not found", listed_at) from None
    size = getattr(handle, "size", None)
    if listed_at is not None and expected and size is not None and size != expected:
        handle.close()
        raise changed(shown, f"{size:,} bytes where the listing said {expected:,}", listed_at)
    return handle
