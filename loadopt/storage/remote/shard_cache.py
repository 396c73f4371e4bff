"""A bounded local cache of a remote dataset's files (`storage.cache_limit`), for datasets whose files hold
many samples (WebDataset tars, Parquet files, record files; an ImageFolder's images too).

`ShardCacheFileSystem` wraps the tier filesystem (`EmulatedFileSystem`), so every byte fetched from the
storage still crosses the tier and is counted there. The first read of any range of a file fetches the
whole file into the cache folder (`$LOADOPT_CACHE/shard-cache/<key of the dataset's location and
endpoint>/`: `CacheFolder` says how threads and processes share it), then every range of it is
read from the local copy: `cat_file` ranges, `open(path, "rb")` files (Parquet, npz), whole files. The
least recently used copies are evicted to keep the folder at or below the limit; a file larger than the
limit is read through, uncached. `prefetch(paths)` fetches an epoch's files ahead in the background, in
order, and stops where it would have to evict one it fetched or found earlier in the list.

The counters (`CacheCounters`: reads served from a copy or not, files and bytes fetched, fetched
ahead, evicted) are shared by every process reading through the same instance, as the tier's are, and
reported with them: `tiers.tier_counters` merges them in under `cache_` names, so a run's `tier_counters` in
`results.json` holds them beside the tier's `bytes` (what crossed to the storage). A fetch costs a size
request (a HEAD over HTTP) and range requests of 1-8 MiB through the tier, `storage.cache_fetches` in flight
(`RangedFetch`); a read from a copy, none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from fsspec.spec import AbstractBufferedFile

from loadopt.storage.remote.access import display_name, redact
from loadopt.storage.remote.cache_counters import CacheCounters, SharedCounts
from loadopt.storage.remote.cache_fetch import RangedFetch
from loadopt.storage.remote.cache_folder import CacheFolder, Refused, Reservation, let_go
from loadopt.storage.remote.listing import endpoint
from loadopt.storage.sources.shards import shard_table
from loadopt.storage.tiers.state import remove_state, state_root

log = logging.getLogger(__name__)

FOLDER = "shard-cache"
DEFAULT_FETCHES = 8  # range requests in flight, fetching ahead or a file a read needs (storage.cache_fetches)
_ATTEMPTS = 4  # fetches of one read before it is read through (each lost its copy to eviction at once)


def cache_key(location: str, storage_options: dict[str, Any] | None) -> str:
    """The cache folder's name for a dataset at `location`: a digest of the URL (credentials redacted) and of
    what selects the endpoint, never a secret (as the saved listings' key)."""
    identity = json.dumps({"location": redact(location), "endpoint": endpoint(location, storage_options)},
                          sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def _bounds(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    first = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
    last = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
    return first, last


class ShardCacheFileSystem(fsspec.AbstractFileSystem):
    """`tier` read through a local cache of whole files in `folder`, at most `limit` bytes; listing passes
    through. Read-only; paths are the tier's own. `generation` (the dataset's fingerprint) is part of each
    copy's name, so a dataset listed again with other files never reads a stale copy (the old ones age out).
    `state_dir` is set when unpickled in another process (the same counters); leave it out to start new ones."""

    protocol = "loadopt-shard-cache"
    cachable = False
    root_marker = ""

    def __init__(self, tier: fsspec.AbstractFileSystem, folder: str | os.PathLike[str], limit: int,
                 generation: str = "", state_dir: str | None = None, fetches: int = DEFAULT_FETCHES,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tier, self.limit, self.generation, self.fetches = tier, int(limit), generation, max(1, int(fetches))
        if state_dir is None:
            state_dir = str(state_root() / f"cache-{uuid.uuid4().hex}")
            weakref.finalize(self, remove_state, state_dir, os.getpid())
        self.state_dir = state_dir
        self.shared = SharedCounts(state_dir)
        self.store = CacheFolder(Path(folder), self.limit, self.shared.add)
        self.store.ensure()
        self._sizes: dict[str, int | None] = {}  # remote sizes learned by this process
        self._said_too_large = self._said_unwritable = False
        self._ahead: tuple[int, threading.Thread, threading.Event] | None = None

    def __reduce__(self):  # by reference to the folder and the counters: other processes join them
        return type(self), (self.tier, str(self.store.folder), self.limit, self.generation, self.state_dir,
                            self.fetches)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path  # paths are the tier's own

    def unstrip_protocol(self, name: str) -> str:
        return self.tier.unstrip_protocol(name)

    def entry(self, path: str) -> str:
        """The name of `path`'s copy in the folder: a digest of the path and generation, and its base name."""
        digest = hashlib.sha256(f"{self.generation}\0{path}".encode()).hexdigest()[:20]
        base = "".join(c if c.isalnum() or c in "-_" else "_" for c in path.rsplit("/", 1)[-1])[-60:]
        return f"{digest}-{base}"

    def copy_path(self, path: str) -> Path:
        """Where `path`'s copy lives in the folder (whether or not it is there now)."""
        return self.store.copy(self.entry(path))

    def cache_counters(self) -> CacheCounters:
        return self.shared.read()

    def counters(self) -> dict[str, float]:
        """The tier's counters (what crossed to the storage) with the cache's, as `tiers.tier_counters` gives them."""
        tier = self.tier.counters() if hasattr(self.tier, "counters") else {}
        return {**tier, **self.cache_counters().as_counters()}

    # --- listing: passed through -----------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any):
        return self.tier.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.tier.info(path, **kwargs)

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs):
        return self.tier.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.tier.exists(path, **kwargs)

    def isdir(self, path: str) -> bool:
        return self.tier.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.tier.isfile(path)

    def size(self, path: str) -> int | None:
        return self.tier.size(path)

    # --- reads: from the copy ---------------------------------------------------------------------
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        entry = self.entry(path)
        data = self._from_copy(entry, start, end)
        if data is not None:
            self.shared.add(hit_reads=1, hit_bytes=len(data))
            return data
        size = self._remote_size(path)
        for _ in range(_ATTEMPTS):
            if size is None or size > self.limit or not self._fetch(path, entry, size):
                break
            data = self._from_copy(entry, start, end)
            if data is not None:
                self.shared.add(miss_reads=1, miss_bytes=len(data))
                return data
        data = self.tier.cat_file(path, start=start, end=end, **kwargs)
        self.shared.add(miss_reads=1, miss_bytes=len(data), uncached_reads=1)
        return data

    def _from_copy(self, entry: str, start: int | None, end: int | None) -> bytes | None:
        fd = self.store.open_copy(entry)
        if fd is None:
            return None
        try:
            first, last = _bounds(start, end, os.fstat(fd).st_size)
            return os.pread(fd, last - first, first) if last > first else b""
        finally:
            let_go(fd)  # the copy may be evicted from now on

    def derived(self, path: str, kind: str, build: Callable[[int, int], None] | None, bound: int) -> int | None:
        """A local file derived from `path`'s copy (its `kind`, e.g. the JPEGs of its JPEG XL members), open for
        reading and share-locked (`let_go` it after the read): built once, by `build(copy_fd, out_fd)` writing at
        most `bound` bytes, then kept beside the copies, counted in the limit and evicted as they are (made only in
        room already free: never at the cost of a copy), so that a form costly to make from the copy is made once
        per cache rather than once per read. None where it is not
        there and is not built now: no copy of `path`, no room, another thread or process building it, or no
        `build` given (only opened)."""
        entry = f"{self.entry(path)}.{kind}"
        fd = self.store.open_copy(entry)
        if fd is not None or build is None:
            return fd
        source = self.store.open_copy(self.entry(path))
        if source is None:
            return None
        try:
            outcome = self.store.reserve(entry, bound, evict=False)
            if not isinstance(outcome, Reservation):
                return self.store.open_copy(entry) if outcome.why == "cached" else None
            try:
                build(source, outcome.fd)
            except BaseException:
                self.store.abandon(outcome)
                raise
            written = os.fstat(outcome.fd).st_size
            self.store.publish(outcome)
            self.shared.add(derived_files=1, derived_bytes=written)
        finally:
            let_go(source)
        return self.store.open_copy(entry)

    def _remote_size(self, path: str) -> int | None:
        """The file's size on the storage (a request the first time this process asks; None: not known, so
        not cached), and the one line saying so once when it is over the limit."""
        if path not in self._sizes:
            try:
                listed = self.tier.size(path)
            except FileNotFoundError:
                raise
            except Exception:  # noqa: BLE001 - read through, the tier retries the read and says what failed
                return None
            size = self._sizes[path] = None if listed is None else int(listed)
            if size is not None and size > self.limit and not self._said_too_large:
                self._said_too_large = True
                log.warning("%s: %s bytes, more than storage.cache_limit (%s bytes): files this large are read "
                            "through, uncached", display_name(self.tier, path), f"{size:,}", f"{self.limit:,}")
        return self._sizes[path]

    def _fetch(self, path: str, entry: str, size: int) -> bool:
        """The copy of `path` (`size` bytes) made, or waited for where another thread or process is making
        it; False when it will not be cached (no room without evicting copies in use)."""
        outcome = self.store.reserve(entry, size)
        if isinstance(outcome, Reservation):
            return self._download(path, outcome)
        if outcome.why == "busy" and outcome.temp is not None:
            self.store.wait(outcome.temp)
        return outcome.why in ("busy", "cached")

    def _download(self, path: str, reservation: Reservation) -> bool:
        """The file fetched whole through the tier into its reservation (its ranges `fetches` at once), then
        published; False (nothing kept) when the storage gave other than its size (it changed: the read through
        says so) or when the copy cannot be written here (a full disk: said once, and the reads go through)."""
        fetch = self._ranged(path, reservation, None, ahead=False)
        if len(fetch.ranges) <= 1 or self.fetches <= 1:
            for start, end in fetch.ranges:
                fetch.fetch(start, end)
        else:
            with ThreadPoolExecutor(min(self.fetches, len(fetch.ranges)), thread_name_prefix="loadopt-cache") as pool:
                list(pool.map(lambda r: fetch.fetch(*r), fetch.ranges))
        return self._kept(path, fetch)

    def _ranged(self, path: str, reservation: Reservation, stop: threading.Event | None, ahead: bool) -> RangedFetch:
        def published(size: int) -> None:
            self.shared.add(fetched_files=1, fetched_bytes=size, ahead_files=int(ahead), ahead_bytes=size * ahead)

        return RangedFetch(self.tier, self.store, path, reservation, self.fetches, stop, published)

    def _kept(self, path: str, fetch: RangedFetch) -> bool:
        kept, unwritable = fetch.outcome()
        if fetch.changed:
            self._sizes.pop(path, None)
        return self._cannot_write(unwritable) if unwritable is not None else kept

    def _cannot_write(self, exc: OSError) -> bool:
        if not self._said_unwritable:
            self._said_unwritable = True
            log.warning("%s: cannot write a copy into the shard cache (%s): files it cannot hold are read through, "
                        "uncached", self.store.folder, exc.strerror or exc)
        return False

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: dict | None = None, **kwargs: Any):
        if mode != "rb":
            raise PermissionError(f"{path}: the shard cache is read-only")
        fd = self.store.open_copy(self.entry(path))
        size: int | None = None
        if fd is not None:
            size = os.fstat(fd).st_size
            let_go(fd)
        else:
            size = self._remote_size(path)
        if size is None or size > self.limit:
            return self.tier.open(path, "rb", block_size=block_size, cache_options=cache_options, **kwargs)
        return _CachedFile(self, path, mode, block_size or "default", cache_options=cache_options, size=size,
                           **kwargs)

    # --- fetching ahead ---------------------------------------------------------------------------
    def prefetch(self, paths: list[str], concurrency: int | None = None) -> None:
        """Fetch these files ahead in the background, in order, at most `concurrency` (default: storage.cache_fetches)
        at a time; stop where the room for the next would take evicting one earlier in the list (it is read sooner).
        Returns at once; a new call replaces the previous one's list, `close()` stops it."""
        self.close()
        stop = threading.Event()
        at_once = self.fetches if concurrency is None else max(1, concurrency)
        thread = threading.Thread(target=self._prefetch, args=(list(dict.fromkeys(paths)), at_once, stop),
                                  name="loadopt-cache-ahead", daemon=True)
        self._ahead = (os.getpid(), thread, stop)
        thread.start()

    def close(self) -> None:
        """Stop fetching ahead (a fetch under way is given up between requests) and wait for it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == os.getpid():  # a forked child's copy names the parent's thread
            ahead[2].set()
            ahead[1].join()

    def wait_ahead(self, timeout: float | None = None) -> bool:
        """Until the fetching ahead has ended (every file fetched, or stopped); False if `timeout` passed first."""
        ahead = self._ahead
        if ahead is None or ahead[0] != os.getpid():
            return True
        ahead[1].join(timeout)
        return not ahead[1].is_alive()

    def _prefetch(self, paths: list[str], concurrency: int, stop: threading.Event) -> None:
        # Range requests, `concurrency` in flight, taken in the files' order: the first file's ranges go out
        # together, so it arrives at the link's rate however little each connection gets, and the first batch,
        # which waits for it, comes soonest; each file after it likewise.
        slots = threading.BoundedSemaphore(concurrency)
        earlier: set[str] = set()
        fetching: list[RangedFetch] = []
        with ThreadPoolExecutor(concurrency, thread_name_prefix="loadopt-cache-ahead") as pool:
            for path in paths:
                entry = self.entry(path)
                try:
                    size = None if self.store.has(entry) else self._remote_size(path)
                    outcome = Refused("cached") if size is None else self.store.reserve(entry, size, keep=earlier)
                except Exception as exc:  # noqa: BLE001 - the read that needs it meets the error itself
                    log.debug("fetching ahead %s: %s", redact(path), exc)
                    outcome = Refused("busy")
                earlier.add(entry)
                if isinstance(outcome, Refused) and outcome.why != "no_room":
                    continue  # cached, or being fetched by another reader
                if stop.is_set() or isinstance(outcome, Refused):  # no room without evicting an earlier one
                    if isinstance(outcome, Reservation):
                        self.store.abandon(outcome)
                    break
                fetch = self._ranged(path, outcome, stop, ahead=True)
                fetching.append(fetch)
                for k, (start, end) in enumerate(fetch.ranges):
                    while not slots.acquire(timeout=0.05):
                        if stop.is_set():
                            break
                    if stop.is_set():
                        fetch.skip(len(fetch.ranges) - k)  # never requested: the copy is given up
                        break
                    pool.submit(fetch.fetch, start, end).add_done_callback(lambda _: slots.release())
        for fetch in fetching:
            try:
                self._kept(fetch.path, fetch)
            except Exception as exc:  # noqa: BLE001 - the read that needs it meets the error itself
                log.debug("fetching ahead %s: %s", redact(fetch.path), exc)


class _CachedFile(AbstractBufferedFile):
    """A file read in byte ranges through the cache (each range from the copy, fetched on the first)."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start=start, end=end)


def shard_files_in_order(dataset: object, shard_ids: Sequence[int] | np.ndarray) -> list[str]:
    """The files holding these shards of `shards.shard_table(dataset)`, in the shards' order, each once (a
    WebDataset's tars, Parquet or record files); empty for a dataset without files of many samples."""
    table = shard_table(dataset)
    firsts = table.bounds[np.asarray(shard_ids, dtype=np.int64)]
    for names, of in (("shards", "shard_of"), ("files", "file_of")):
        files, file_of = getattr(dataset, names, None), getattr(dataset, of, None)
        if isinstance(files, np.ndarray) and isinstance(file_of, np.ndarray) and len(file_of):
            return list(dict.fromkeys(name.decode() for name in files[file_of[firsts]]))
    return []


def fetch_ahead(dataset: object, batches: Sequence[np.ndarray], shard_samples: int) -> None:
    """Where `dataset`'s files are read through a shard cache, have it fetch them ahead in the order the rest of
    an epoch (`batches`) first needs them: under the window shuffle, the rank's shards as dealt to it."""
    fs = getattr(dataset, "fs", None)
    if not isinstance(fs, ShardCacheFileSystem) or not len(batches):
        return
    table = shard_table(dataset, shard_samples)
    owner = np.searchsorted(table.bounds, np.concatenate(list(batches)), side="right") - 1
    _, first = np.unique(owner, return_index=True)
    fs.prefetch(shard_files_in_order(dataset, owner[np.sort(first)]))
