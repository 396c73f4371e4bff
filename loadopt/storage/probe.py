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
import mmap
import multiprocessing
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from loadopt.errors import ConfigError, DatasetError
from loadopt.storage.pagecache import evict

KiB, MiB = 1024, 1024 * 1024
DEFAULT_BLOCKS = (4 * KiB, 128 * KiB, MiB)
DEFAULT_CONCURRENCY = (1, 4, 16, 64)
_OPEN_FILES = 8  # descriptors each reader keeps open
_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the logical block size

ProgressFn = Callable[[str, int, int], None]  # (pattern label, patterns done, patterns in all)
# (rng, count) -> (file indices, offsets, lengths) of the next `count` requests of one reader
Picker = Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class _File:
    path: str
    size: int


class _Reader:
    """Reads `length` bytes at `offset` of a file; one per thread (local readers own a buffer)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, local: bool, direct: bool, max_length: int) -> None:
        self.fs, self.local, self.direct = fs, local, direct
        self._fds: dict[str, int] = {}
        # mmap memory is page-aligned, as O_DIRECT requires; reused for every read of this thread.
        self._buffer = mmap.mmap(-1, _round_up(max(max_length, 1), _ALIGN)) if local else None
        self._views: dict[int, list[memoryview]] = {}

    def read(self, file: _File, offset: int, length: int) -> int:
        if not self.local:
            return len(self.fs.cat_file(file.path, start=offset, end=offset + length))
        fd = self._fds.get(file.path)
        if fd is None:
            if len(self._fds) >= _OPEN_FILES:  # a folder of many files: keep few open (64 readers share the limit)
                os.close(self._fds.pop(next(iter(self._fds))))
            flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
            fd = self._fds[file.path] = os.open(file.path, flags)
        views = self._views.get(length)
        if views is None:  # one view per read length (blocks: one in all), made once
            span = _round_up(length, _ALIGN) if self.direct else length
            views = self._views[length] = [memoryview(self._buffer)[:span]]
        return min(os.preadv(fd, views, offset), length)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for views in self._views.values():
            views[0].release()
        self._views.clear()
        if self._buffer is not None:
            self._buffer.close()


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol
    return "file" in ((protocol,) if isinstance(protocol, str) else tuple(protocol))


def _direct_works(path: str) -> bool:
    """O_DIRECT is refused by some file systems (tmpfs, some overlays): fall back to buffered reads."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        buffer = mmap.mmap(-1, _ALIGN)
        try:
            os.preadv(fd, [buffer], 0)
        finally:
            buffer.close()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _list_files(fs: fsspec.AbstractFileSystem, path: str, url: str) -> tuple[list[_File], bool]:
    """(the files at `path`, whether it is a folder)."""
    try:
        if not fs.exists(path):
            raise DatasetError(f"{url}: not found")
        if not fs.isdir(path):
            return [_File(path, int(fs.info(path).get("size") or 0))], False
        found = fs.find(path, detail=True)
    except DatasetError:
        raise
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{url}: cannot list it ({exc})") from None
    files = [_File(name, int(info.get("size") or 0)) for name, info in sorted(found.items())
             if info.get("type", "file") == "file" and int(info.get("size") or 0) > 0]
    if not files:
        raise DatasetError(f"{url}: holds no non-empty files to read")
    return files, True


def _latency_stats(latencies: list[float], nbytes: int, seconds: float) -> dict[str, Any]:
    lat = np.asarray(latencies) * 1000.0
    requests = len(lat)
    return {"requests": requests, "bytes": nbytes, "seconds": seconds,
            "iops": requests / seconds if seconds > 0 else 0.0,
            "mb_per_s": nbytes / seconds / 1e6 if seconds > 0 else 0.0,
            "lat_mean_ms": float(lat.mean()) if requests else None,
            "lat_p50_ms": float(np.percentile(lat, 50)) if requests else None,
            "lat_p99_ms": float(np.percentile(lat, 99)) if requests else None}


def _thread_loop(make_reader: Callable[[], _Reader], files: list[_File], pick: Picker, seed: int, quota: int,
                 t_start: float, t_end: float) -> tuple[list[int], int, float]:
    """One reader thread: requests until `t_end` or `quota`; (latencies in ns, bytes read, end time)."""
    reader = make_reader()
    rng = np.random.default_rng(seed)
    latencies: list[int] = []
    nbytes, count, ended = 0, 0, time.perf_counter()
    clock, read = time.perf_counter_ns, reader.read
    end_ns = int(t_end * 1e9)
    try:
        _sleep_until(t_start)
        while count < quota:
            chosen, offsets, lengths = pick(rng, min(1024, quota - count))
            for index, offset, length in zip(chosen.tolist(), offsets.tolist(), lengths.tolist(), strict=True):
                began = clock()
                nbytes += read(files[index], offset, length)
                done = clock()
                latencies.append(done - began)
                count += 1
                if done >= end_ns:
                    return latencies, nbytes, done / 1e9
            ended = time.perf_counter()
    finally:
        reader.close()
    return latencies, nbytes, ended


def _threads(make_reader: Callable[[], _Reader], files: list[_File], pick: Picker, threads: int, seed: int,
             quota: int, t_start: float, t_end: float) -> tuple[list[int], int, float]:
    """`threads` reader threads in this process; their latencies, bytes and last end time together."""
    out: list[tuple[list[int], int, float] | None] = [None] * threads
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            out[index] = _thread_loop(make_reader, files, pick, seed * 1009 + index, quota, t_start, t_end)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    done = [o for o in out if o is not None]
    return [v for lat, _, _ in done for v in lat], sum(n for _, n, _ in done), max(e for _, _, e in done)


def _process_main(queue, *args) -> None:
    try:
        lat, nbytes, ended = _threads(*args)
        queue.put((np.asarray(lat, dtype=np.int64), nbytes, ended, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as text
        queue.put((None, 0, 0.0, f"{type(exc).__name__}: {exc}"))


def _run_concurrent(make_reader: Callable[[], _Reader], files: list[_File], pick: Picker, concurrency: int,
                    processes: int, duration_s: float, max_requests: int, seed: int) -> dict[str, Any]:
    """`concurrency` readers for `duration_s`, as threads spread over `processes` forked processes
    (one process: threads here). Python threads share one GIL: past ~8 readers of small blocks the
    interpreter, not the storage, would be the limit, so local patterns spread them over the cores."""
    quota = max(1, -(-max_requests // concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    t_start = time.perf_counter() + 0.02 + 0.03 * (processes - 1)  # every reader starts at once
    t_end = t_start + duration_s
    if processes == 1:
        lat, nbytes, ended = _threads(make_reader, files, pick, concurrency, seed, quota, t_start, t_end)
        latencies = np.asarray(lat, dtype=np.int64)
    else:
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        procs = [context.Process(target=_process_main, daemon=True,
                                 args=(queue, make_reader, files, pick, share, seed * 7919 + i, quota, t_start, t_end))
                 for i, share in enumerate(shares)]
        for proc in procs:
            proc.start()
        parts = [queue.get() for _ in procs]
        for proc in procs:
            proc.join()
        failed = next((p[3] for p in parts if p[3] is not None), None)
        if failed is not None:
            raise OSError(failed)
        latencies = np.concatenate([p[0] for p in parts])
        nbytes, ended = sum(p[1] for p in parts), max(p[2] for p in parts)
    return _latency_stats(latencies / 1e9, nbytes, max(ended - t_start, 1e-9))


def _sleep_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _processes_for(concurrency: int, local: bool) -> int:
    """Forked processes for a pattern: local reads only (remote clients hold threads and event loops
    that do not survive a fork), about 8 readers a process, at most two processes a core."""
    if not local or concurrency < 16 or not hasattr(os, "fork"):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2 * cores, concurrency // 8))


def probe(url: str, *, block_sizes: tuple[int, ...] = DEFAULT_BLOCKS,
          concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCY, duration_s: float = 3.0, seq_block: int = MiB,
          seq_bytes: int = 1 << 30, max_requests: int = 1_000_000, whole_files: bool | None = None,
          cold: bool = True, direct: bool = True, file_size: int | None = None,
          fs: fsspec.AbstractFileSystem | None = None, seed: int = 0, sequential: bool = True,
          progress: ProgressFn | None = None) -> dict[str, Any]:
    """Measure the storage at `url` (a file or folder; a path within `fs` when given) and return the
    figures as a JSON-ready dict: `patterns`, one entry per pattern, and what was read and how.
    `sequential=False` leaves the sequential pattern out."""
    if fs is None:
        try:
            fs, path = fsspec.core.url_to_fs(os.path.expanduser(url))
        except (ImportError, ValueError) as exc:
            raise DatasetError(f"{url}: cannot open this location ({exc})") from None
    else:
        path = url
    test_file = None
    if file_size is not None:
        test_file = _write_test_file(fs, path, url, file_size)
    try:
        files, is_folder = _list_files(fs, test_file or path, url)
        return _probe_files(url, fs, files, is_folder and test_file is None, block_sizes, concurrencies, duration_s,
                            seq_block if sequential else 0, seq_bytes, max_requests, whole_files, cold, direct, seed,
                            progress, test_file is not None)
    finally:
        if test_file is not None:
            with contextlib.suppress(OSError):
                fs.rm_file(test_file)


def _write_test_file(fs: fsspec.AbstractFileSystem, folder: str, url: str, size: int) -> str:
    if size <= 0:
        raise DatasetError(f"{url}: --file-size must be positive, got {size}")
    try:
        if not fs.isdir(folder):
            raise DatasetError(f"{url}: --file-size writes a test file into a folder; this is not a folder")
        name = folder.rstrip("/") + f"/.loadopt-probe-{secrets.token_hex(4)}.bin"
        chunk = np.random.default_rng(0).integers(0, 256, min(size, 8 * MiB), dtype=np.uint8).tobytes()
        with fs.open(name, "wb") as handle:
            written = 0
            while written < size:
                part = chunk[: size - written]
                handle.write(part)
                written += len(part)
    except DatasetError:
        raise
    except OSError as exc:
        raise DatasetError(f"{url}: cannot write the probe's test file ({exc})") from None
    return name


def _probe_files(url: str, fs: fsspec.AbstractFileSystem, files: list[_File], is_folder: bool,
                 block_sizes: tuple[int, ...], concurrencies: tuple[int, ...], duration_s: float, seq_block: int,
                 seq_bytes: int, max_requests: int, whole_files: bool | None, cold: bool, direct: bool, seed: int,
                 progress: ProgressFn | None, wrote_test_file: bool) -> dict[str, Any]:
    local = _is_local(fs)
    direct = bool(direct and local and _direct_works(files[0].path))
    whole_files = is_folder if whole_files is None else whole_files
    largest = max(f.size for f in files)
    plan: list[tuple[str, int, int]] = [("sequential", seq_block, 1)] if seq_block else []
    plan += [("random", block, c) for block in block_sizes for c in concurrencies]
    if whole_files:
        plan += [("files", 0, c) for c in concurrencies]
    local_paths = [f.path for f in files] if local else []
    patterns: list[dict[str, Any]] = []
    for done, (kind, block, concurrency) in enumerate(plan):
        label = f"{kind} {_size_label(block)} x{concurrency}" if kind == "random" else f"{kind} x{concurrency}"
        if progress is not None:
            progress(label, done, len(plan))
        entry: dict[str, Any] = {"pattern": kind, "block_bytes": block, "concurrency": concurrency}
        fitting = [f for f in files if f.size >= block] if kind == "random" else files
        if not fitting:
            entry["skipped"] = f"no file holds {_size_label(block)} (largest {largest:,} bytes)"
            patterns.append(entry)
            continue
        if cold and local_paths:
            evict(local_paths)
        max_length = max(f.size for f in fitting) if kind == "files" else block
        make_reader = lambda max_length=max_length: _Reader(fs, local, direct, max_length)  # noqa: E731
        if kind == "sequential":
            entry.update(_sequential(make_reader(), files, seq_block, seq_bytes, duration_s))
        else:
            pick = _file_picker(fitting) if kind == "files" else _offset_picker(fitting, block)
            entry.update(_run_concurrent(make_reader, fitting, pick, concurrency, _processes_for(concurrency, local),
                                         duration_s, max_requests, seed + done))
        if kind == "files":
            entry["block_bytes"] = entry["bytes"] / entry["requests"] if entry["requests"] else 0
        patterns.append(entry)
    if progress is not None:
        progress("done", len(plan), len(plan))
    return {"url": url, "local": local, "direct": direct, "cold": bool(cold and local),
            "cache_note": _cache_note(local, cold, direct), "files": len(files),
            "total_bytes": sum(f.size for f in files), "test_file_written": wrote_test_file,
            "duration_s": duration_s, "patterns": patterns}


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


def _offset_picker(files: list[_File], block: int) -> Picker:
    """Files (weighted by their block positions) and block-aligned offsets in them, as fio's randread."""
    positions = np.cumsum([f.size // block for f in files])
    total = int(positions[-1])
    before = np.concatenate([[0], positions[:-1]])

    def pick(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        slots = rng.integers(0, total, count)
        chosen = np.searchsorted(positions, slots, side="right")
        return chosen, (slots - before[chosen]) * block, np.full(count, block)

    return pick


def _file_picker(files: list[_File]) -> Picker:
    sizes = np.array([f.size for f in files])

    def pick(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chosen = rng.integers(0, len(files), count)
        return chosen, np.zeros(count, dtype=np.int64), sizes[chosen]

    return pick


def _sequential(reader: _Reader, files: list[_File], block: int, max_bytes: int, duration_s: float) -> dict[str, Any]:
    """Read the files in order, `block` bytes at a time, pass after pass (as fio's `time_based` does),
    until `max_bytes` or the time is up."""
    latencies: list[float] = []
    nbytes = 0
    began = time.perf_counter()
    deadline = began + duration_s
    try:
        while nbytes < max_bytes and time.perf_counter() < deadline:
            before = nbytes
            for file in files:
                offset = 0
                while offset < file.size and nbytes < max_bytes:
                    length = min(block, file.size - offset)
                    start = time.perf_counter()
                    got = reader.read(file, offset, length)
                    end = time.perf_counter()
                    latencies.append(end - start)
                    nbytes += got
                    offset += length
                    if got == 0 or end >= deadline:
                        break
                if nbytes >= max_bytes or time.perf_counter() >= deadline:
                    break
            if nbytes == before:  # nothing to read (empty files)
                break
    finally:
        reader.close()
    return _latency_stats(latencies, nbytes, time.perf_counter() - began)


def summary(result: dict[str, Any]) -> dict[str, float | None]:
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
