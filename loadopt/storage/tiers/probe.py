"""`probe`: what a storage location delivers: sequential bandwidth, random-read IOPS, MB/s and latency.

Patterns (each run for `duration_s` or until its byte/request budget is spent, whichever is first):
- `sequential`: one reader going through the file(s) in order in `seq_block` chunks (fio `rw=read`).
- `random`: `concurrency` threads each reading `block` bytes at block-aligned random offsets
  (fio `rw=randread`, `numjobs=concurrency`, `ioengine=psync`), for every block size x concurrency.
- `files` (folders only): `concurrency` threads each reading whole files picked at random: what a
  loader of a folder of samples (an ImageFolder) asks of its storage.

What is read: a file URL is read as it is. A folder URL is read through its files (offsets drawn
among the positions where a block fits; a block larger than every file is skipped and said so), or,
with `file_size`, through one test file of that size written into the folder first and removed
afterwards (the only case in which probe writes anything).

Local files are read with `os.preadv` from threads (the GIL is released during the read) and are
cold: the page cache is evicted before every pattern (posix_fadvise DONTNEED), and by default they
are opened with O_DIRECT (as fio's `direct=1`) so that no pattern reads what another one cached.
Other fsspec locations (http, s3, emulated tiers) are read with `cat_file(path, start, end)` from
threads; they have no page cache here to evict.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np
from typing_extensions import NotRequired, TypedDict

from loadopt.errors import ConfigError, DatasetError
from loadopt.storage.remote.access import is_local_fs, open_url, redact, storage_errors, storage_failure, why_missing
from loadopt.storage.tiers.pagecache import evict
from loadopt.storage.tiers.probe_readers import (
    File,
    LatencyStats,
    Picker,
    Reader,
    direct_works,
    latency_stats,
    processes_for,
    run_concurrent,
)
from loadopt.storage.tiers.sequential import read_sequential

KiB, MiB = 1024, 1024 * 1024
DEFAULT_BLOCKS = (4 * KiB, 128 * KiB, MiB)
DEFAULT_CONCURRENCY = (1, 4, 16, 64)

ProgressFn = Callable[[str, int, int], None]  # (pattern label, patterns done, patterns in all)


class PatternResult(TypedDict):
    """One pattern of a probe: what it read and, unless it was skipped, what it delivered (LatencyStats)."""

    pattern: str  # sequential | random | files
    block_bytes: float  # a `files` pattern: the mean bytes of a request (a whole file)
    concurrency: int
    skipped: NotRequired[str]  # why it was not run (no file holds a block); then none of the figures below
    requests: NotRequired[int]
    bytes: NotRequired[int]
    seconds: NotRequired[float]
    iops: NotRequired[float]
    mb_per_s: NotRequired[float]
    lat_mean_ms: NotRequired[float | None]
    lat_p50_ms: NotRequired[float | None]
    lat_p99_ms: NotRequired[float | None]


class ProbeResult(TypedDict):
    """What `probe` measured (`loadopt probe`'s JSON): what was read and how, and each pattern's figures."""

    url: str  # credentials redacted
    local: bool
    direct: bool  # O_DIRECT reads
    cold: bool  # the page cache evicted before each pattern
    cache_note: str
    files: int
    total_bytes: int
    test_file_written: bool
    duration_s: float
    patterns: list[PatternResult]
    tier: NotRequired[str]  # `loadopt probe --tier`'s (local without one): set by the command, in probe.json


def _list_files(fs: fsspec.AbstractFileSystem, path: str, url: str) -> tuple[list[File], bool]:
    """(the files at `path`, whether it is a folder); `url` (credentials and all) names it in errors."""
    shown = redact(url)
    with storage_errors(url, "list it"):
        if not fs.exists(path):  # remote drivers say False for a host that refused too: ask why
            raise DatasetError(f"{shown}: {why_missing(fs, path, url)}")
        if not fs.isdir(path):
            return [File(path, int(fs.info(path).get("size") or 0))], False
        found = {name: info for name, info in fs.find(path, detail=True).items() if info.get("type", "file") == "file"}
        unsized = [name for name, info in found.items() if info.get("size") is None]
        if unsized:  # HTTP directory listings carry no sizes: ask for them (HEAD), overlapped
            with ThreadPoolExecutor(16) as pool:
                for name, size in zip(unsized, pool.map(fs.size, unsized), strict=True):
                    found[name] = {**found[name], "size": size}
    files = [File(name, int(info.get("size") or 0)) for name, info in sorted(found.items())
             if int(info.get("size") or 0) > 0]
    if not files:
        raise DatasetError(f"{shown}: holds no non-empty files to read")
    return files, True


def probe(url: str, *, block_sizes: tuple[int, ...] = DEFAULT_BLOCKS,
          concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCY, duration_s: float = 3.0, seq_block: int = MiB,
          seq_bytes: int = 1 << 30, max_requests: int = 1_000_000, whole_files: bool | None = None,
          cold: bool = True, direct: bool = True, file_size: int | None = None,
          fs: fsspec.AbstractFileSystem | None = None, seed: int = 0, sequential: bool = True,
          progress: ProgressFn | None = None, source: str | None = None) -> ProbeResult:
    """Measure the storage at `url` (a file or folder; a path within `fs` when given) and return the
    figures as a JSON-ready dict: `patterns`, one entry per pattern, and what was read and how.
    `sequential=False` leaves the sequential pattern out. `source`: the URL a path in `fs` was opened
    from, which errors name (credentials redacted)."""
    if fs is None:
        fs, path = open_url(os.path.expanduser(url))
    else:
        path, url = url, source or url
    test_file = None
    if file_size is not None:
        test_file = _write_test_file(fs, path, url, file_size)
    try:
        files, is_folder = _list_files(fs, test_file or path, url)
        with storage_errors(url, "read it"):
            result = _probe_files(redact(url), fs, files, is_folder and test_file is None, block_sizes,
                                  concurrencies, duration_s, seq_block if sequential else 0, seq_bytes, max_requests,
                                  whole_files, cold, direct, seed, progress, test_file is not None)
        return redact(result)
    finally:
        if test_file is not None:
            with contextlib.suppress(Exception):  # the storage may be what failed
                fs.rm_file(test_file)


def _write_test_file(fs: fsspec.AbstractFileSystem, folder: str, url: str, size: int) -> str:
    if size <= 0:
        raise DatasetError(f"{redact(url)}: --file-size must be positive, got {size}")
    name = folder.rstrip("/") + f"/.loadopt-probe-{secrets.token_hex(4)}.bin"
    try:
        if not fs.isdir(folder):
            raise DatasetError(f"{redact(url)}: --file-size writes a test file into a folder; this is not a folder")
        chunk = np.random.default_rng(0).integers(0, 256, min(size, 8 * MiB), dtype=np.uint8).tobytes()
        with fs.open(name, "wb") as handle:
            written = 0
            while written < size:
                part = chunk[: size - written]
                handle.write(part)
                written += len(part)
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001 - remote drivers raise their own types (aiohttp, botocore)
        with contextlib.suppress(Exception):  # a part written before the failure
            fs.rm_file(name)
        failure = storage_failure(url, exc, "write the probe's test file")
        if failure is None:
            raise
        raise failure from None
    return name


def _probe_files(url: str, fs: fsspec.AbstractFileSystem, files: list[File], is_folder: bool,
                 block_sizes: tuple[int, ...], concurrencies: tuple[int, ...], duration_s: float, seq_block: int,
                 seq_bytes: int, max_requests: int, whole_files: bool | None, cold: bool, direct: bool, seed: int,
                 progress: ProgressFn | None, wrote_test_file: bool) -> ProbeResult:
    local = is_local_fs(fs)
    direct = bool(direct and local and direct_works(files[0].path))
    whole_files = is_folder if whole_files is None else whole_files
    largest = max(f.size for f in files)
    plan: list[tuple[str, int, int]] = [("sequential", seq_block, 1)] if seq_block else []
    plan += [("random", block, c) for block in block_sizes for c in concurrencies]
    if whole_files:
        plan += [("files", 0, c) for c in concurrencies]
    local_paths = [f.path for f in files] if local else []
    patterns: list[PatternResult] = []
    for done, (kind, block, concurrency) in enumerate(plan):
        label = f"{kind} {_size_label(block)} x{concurrency}" if kind == "random" else f"{kind} x{concurrency}"
        if progress is not None:
            progress(label, done, len(plan))
        fitting = [f for f in files if f.size >= block] if kind == "random" else files
        if not fitting:
            patterns.append({"pattern": kind, "block_bytes": block, "concurrency": concurrency,
                             "skipped": f"no file holds {_size_label(block)} (largest {largest:,} bytes)"})
            continue
        if cold and local_paths:
            evict(local_paths)
        max_length = max(f.size for f in fitting) if kind == "files" else block
        make_reader = lambda max_length=max_length: Reader(fs, local, direct, max_length)  # noqa: E731
        stats: LatencyStats
        if kind == "sequential":
            stats = _sequential(fs, local, direct, files, seq_block, seq_bytes, duration_s)
        else:
            pick = _file_picker(fitting) if kind == "files" else _offset_picker(fitting, block)
            stats = run_concurrent(make_reader, fitting, pick, concurrency, processes_for(concurrency, local),
                                   duration_s, max_requests, seed + done)
        if kind == "files":  # the mean whole file read
            block_bytes: float = stats["bytes"] / stats["requests"] if stats["requests"] else 0
        else:
            block_bytes = block
        patterns.append({"pattern": kind, "block_bytes": block_bytes, "concurrency": concurrency, **stats})
    if progress is not None:
        progress("done", len(plan), len(plan))
    return ProbeResult(url=url, local=local, direct=direct, cold=bool(cold and local),
                       cache_note=_cache_note(local, cold, direct), files=len(files),
                       total_bytes=sum(f.size for f in files), test_file_written=wrote_test_file,
                       duration_s=duration_s, patterns=patterns)


def _cache_note(local: bool, cold: bool, direct: bool) -> str:
    if not local:
        return "remote: no page cache here to evict"
    parts = ["page cache evicted before each pattern" if cold else "page cache left as it was"]
    parts.append("O_DIRECT reads (as fio direct=1)" if direct else "buffered reads")
    return ", ".join(parts)


def _size_label(nbytes: int) -> str:
    if nbytes >= MiB and nbytes % MiB == 0:
        return f"{nbytes // MiB} MiB"
    if nbytes >= KiB and nbytes % KiB == 0:
        return f"{nbytes // KiB} KiB"
    return f"{nbytes} B"


def _offset_picker(files: list[File], block: int) -> Picker:
    """Files (weighted by their block positions) and block-aligned offsets in them, as fio's randread."""
    positions = np.cumsum([f.size // block for f in files])
    total = int(positions[-1])
    before = np.concatenate([[0], positions[:-1]])

    def pick(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        slots = rng.integers(0, total, count)
        chosen = np.searchsorted(positions, slots, side="right")
        return chosen, (slots - before[chosen]) * block, np.full(count, block)

    return pick


def _file_picker(files: list[File]) -> Picker:
    sizes = np.array([f.size for f in files])

    def pick(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chosen = rng.integers(0, len(files), count)
        return chosen, np.zeros(count, dtype=np.int64), sizes[chosen]

    return pick


def _sequential(fs: fsspec.AbstractFileSystem, local: bool, direct: bool, files: list[File], block: int,
                max_bytes: int, duration_s: float) -> LatencyStats:
    """Read the files in order, `block` bytes at a time, pass after pass (as fio's `time_based` does),
    until `max_bytes` or the time is up."""
    latencies: list[float] = []
    done = read_sequential([f.path for f in files], block, fs=None if local else fs, sizes=[f.size for f in files],
                           direct=direct, max_bytes=max_bytes, max_seconds=duration_s, passes=True,
                           latencies=latencies)
    return latency_stats(latencies, done.nbytes, done.seconds)


def summary(result: ProbeResult) -> dict[str, float | None]:
    """The headline figures: sequential MB/s, and the best random IOPS / MB/s over the patterns."""
    measured = [p for p in result["patterns"] if "skipped" not in p]
    sequential = next((p for p in measured if p["pattern"] == "sequential"), None)
    small = [p for p in measured if p["pattern"] == "random" and p["block_bytes"] == min(
        (q["block_bytes"] for q in measured if q["pattern"] == "random"), default=0)]
    return {"sequential_mb_per_s": sequential["mb_per_s"] if sequential else None,
            "best_random_iops": max((p["iops"] for p in small), default=None),
            "best_mb_per_s": max((p["mb_per_s"] for p in measured), default=None)}


_UNITS = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB, "g": 1 << 30,
          "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str, what: str = "size") -> int:
    """`4k`, `128KiB`, `1m`, `2G` or a plain byte count -> bytes (binary units)."""
    value = text.strip().lower()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):].strip()
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or amount <= 0:
        raise ConfigError(f"{what} {text!r}: expected a positive size such as 4k, 128KiB, 1m or 4096")
    return int(amount * _UNITS[unit])
