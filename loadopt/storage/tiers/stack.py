"""A tier's filesystem stack: the emulating wrapper over the storage, the shard cache over that, and what
a run reads off them (counters, the failure to record, the storage its figures are bounded by)."""

from __future__ import annotations

import json
import logging

import fsspec

from loadopt.errors import DatasetError, StorageError
from loadopt.files import atomic_write_text, cache_dir
from loadopt.storage.remote.access import is_local_fs, redact
from loadopt.storage.remote.listing import endpoint
from loadopt.storage.remote.shard_cache import DEFAULT_FETCHES, FOLDER, ShardCacheFileSystem, cache_key
from loadopt.storage.tiers.emulated import EmulatedFileSystem
from loadopt.storage.tiers.spec import TierSpec

log = logging.getLogger(__name__)


def tier_filesystem(spec: TierSpec, base_fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """`base_fs` read through tier `spec`: the emulating, retrying wrapper, or `base_fs` itself when the
    tier imposes nothing and the storage is a local disk (remote storage always gets retries and counters).

    Each call makes a new tier instance with its own shared state (bandwidth clock, concurrency slots,
    counters): hand the returned filesystem (or a dataset holding it) to the processes that should share
    the tier; it pickles by reference to that state, so spawned processes share it too."""
    base_fs = tier_of(base_fs)  # a new tier over a cached dataset reads the storage, not the old tier's cache
    if isinstance(base_fs, EmulatedFileSystem):  # never stack two tiers: the outer spec applies to the real fs
        base_fs = base_fs.base_fs
    if not spec.emulates() and is_local_fs(base_fs):
        return base_fs
    return EmulatedFileSystem(spec, base_fs)


def tier_of(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """The filesystem under a dataset's local shard cache: its tier; `fs` itself
    when it reads through no cache."""
    return fs.tier if isinstance(fs, ShardCacheFileSystem) else fs


def tier_counters(fs: fsspec.AbstractFileSystem) -> dict[str, float] | None:
    """The counters of the tier `fs` reads through (requests, bytes, retries, injected faults, failed
    reads, ...), summed over every process that shares it; None when `fs` is not a tier wrapper. Under a
    shard cache, the cache's counters too (`cache_hit_reads`, `cache_fetched_bytes`, ...: `CacheCounters`)."""
    if not isinstance(tier_of(fs), EmulatedFileSystem):
        return None
    return fs.counters()


def counters_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What a run added to a tier's counters (None when there is no tier wrapper)."""
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0) for k in after}


def sum_counters(deltas: list[dict[str, float]]) -> dict[str, float]:
    """Counters of several runs (repeats) added up."""
    total: dict[str, float] = {}
    for delta in deltas:
        for key, value in delta.items():
            total[key] = total.get(key, 0) + value
    return total


def tier_failure(exc: BaseException, fs: fsspec.AbstractFileSystem,
                 delta: dict[str, float] | None) -> StorageError | None:
    """The StorageError to record when `exc` ended a run because the tier kept failing, else None.

    A read that gave up raises StorageError where it happens; a loader that reads in worker processes
    reports it as the sample's read error, so the tier's shared `failed_reads` counter decides."""
    if isinstance(exc, StorageError):
        return exc
    fs = tier_of(fs)
    if not delta or not delta.get("failed_reads"):
        return None
    spec = getattr(fs, "spec", None)
    name, attempts = (spec.name, spec.retry.max_attempts) if spec is not None else ("?", "several")
    first = redact((str(exc).splitlines() or [""])[0])
    culprit = first.split(": ", 1)[0]
    # The loaders' read errors start with the file's path; another error (one the failed reads led to) is said as
    # what ended the run, never passed off as a file.
    example = f"e.g. {culprit}" if "/" in culprit else f"the run ended on {type(exc).__name__}: {first}"
    return StorageError(f"storage tier {name!r} keeps failing: {int(delta['failed_reads'])} read(s) gave up after "
                        f"{attempts} attempts each ({int(delta.get('retries', 0))} retries in all), {example}")


# From this share of a tier's request time run past the tier's figures by the storage under it, the figures
# measured through the tier are that storage's, not the tier's (the emulation can only slow it down).
BASE_BOUND_SHARE = 0.2


def base_share(counters: dict[str, float] | None) -> float | None:
    """The share of the requests' time (arrival to end) that the storage under the tier took past the end the
    tier's figures gave them: 0 when the emulation set every request's time; None without requests or a tier."""
    if not counters or not counters.get("request_s"):
        return None
    return float(counters.get("base_over_s", 0.0)) / float(counters["request_s"])


def base_bound_text(tier: str, under: str, mb_s: float | None) -> str:
    """What a figure through tier `tier` says when the storage under it bounded it (`base_share` >= the bound)."""
    rate = f" at {mb_s:,.0f} MB/s" if mb_s is not None else ""
    return f"bounded by the {under}{rate}: not a figure of tier {redact(tier)}"


def storage_under(fs: fsspec.AbstractFileSystem, root: str = "") -> str:
    """The storage a tier's reads end on, as results name it: `local disk`, else the URL's scheme."""
    fs = tier_of(fs)
    base = fs.base_fs if isinstance(fs, EmulatedFileSystem) else fs
    if is_local_fs(base):
        return "local disk"
    return redact(str(root).split("://", 1)[0] + "://") if "://" in str(root) else f"{base.protocol} storage"


def cache_reads(fs: fsspec.AbstractFileSystem, location: str | None, spec: TierSpec, limit: int,
                generation: str, fetches: int = DEFAULT_FETCHES) -> fsspec.AbstractFileSystem:
    """`fs` (a dataset's tier filesystem) read through a shard cache of at most `limit` bytes, kept for the
    dataset at `location`, fetching ahead `fetches` files at once; `fs` itself, said once in the log, where the
    dataset is on the local disk."""
    base = tier_of(fs)
    base = getattr(base, "base_fs", base)
    if location is None or spec.base is None and is_local_fs(base):
        log.info("storage.cache_limit: the dataset is on the local disk (%s): it is read where it is, not cached",
                 location or "the generated dataset in the cache")
        return fs
    folder = cache_dir() / FOLDER / cache_key(location, spec.storage_options)
    try:
        cached = ShardCacheFileSystem(fs, folder, limit, generation, fetches=fetches)
        about = folder / "about.json"
        if not about.exists():  # for whoever looks in the folder: whose copies these are
            text = json.dumps({"location": redact(location), "endpoint": endpoint(location, spec.storage_options)})
            atomic_write_text(about, text + "\n")
    except OSError as exc:
        raise DatasetError(f"{folder}: cannot write the shard cache there ({exc.strerror or exc}); set LOADOPT_CACHE "
                           "to a writable folder, or storage.cache_limit: null") from None
    return cached
