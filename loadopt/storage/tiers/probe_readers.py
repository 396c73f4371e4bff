"""How `probe` issues and times its reads: a reader per thread (local files with `os.preadv` into an
aligned buffer, O_DIRECT where the file system allows it; other fsspec locations with `cat_file`),
and many readers at once, as threads spread over forked processes when one interpreter would be the
limit rather than the storage.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
from typing_extensions import TypedDict

from loadopt.clock import sleep_until
from loadopt.machine import usable_cores
from loadopt.storage.forms.raw_format import ALIGN, align_up
from loadopt.storage.tiers.sequential import AlignedBuffer

try:  # optional (setup.py): without it, each read is issued and timed in Python
    from loadopt.storage import _preads as native
except ImportError:
    native = None  # type: ignore[assignment]  # None where the optional module is absent

_OPEN_FILES = 8  # descriptors each reader keeps open

# (rng, count) -> (file indices, offsets, lengths) of the next `count` requests of one reader
Picker = Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class File:
    path: str
    size: int


class Reader:
    """Reads `length` bytes at `offset` of a file; one per thread (local readers own a buffer)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, local: bool, direct: bool, max_length: int) -> None:
        self.fs, self.local, self.direct = fs, local, direct
        self._fds: dict[str, int] = {}
        # page-aligned (huge pages for large blocks), as O_DIRECT requires; reused for every read of this thread.
        self._buffer = AlignedBuffer(max(max_length, 1)) if local else None
        self._views: dict[int, list[memoryview]] = {}

    def read(self, file: File, offset: int, length: int) -> int:
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
            span = align_up(length) if self.direct else length
            assert self._buffer is not None  # a local reader owns its buffer (made in __init__)
            views = self._views[length] = [self._buffer.view[:span]]
        return min(os.preadv(fd, views, offset), length)

    def native_batch(self, files: list[File]) -> tuple[np.ndarray, memoryview] | None:
        """(a descriptor per file, the buffer) for reads in C, or None where they are read in Python:
        remote readers, no compiled module, more files than a reader keeps open."""
        if native is None or not self.local or len(files) > _OPEN_FILES or self._buffer is None:
            return None
        flags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        for file in files:
            if file.path not in self._fds:
                self._fds[file.path] = os.open(file.path, flags)
        return np.array([self._fds[f.path] for f in files], np.int32), self._buffer.view[:]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for views in self._views.values():
            views[0].release()
        self._views.clear()
        if self._buffer is not None:
            self._buffer.close()


def direct_works(path: str) -> bool:
    """O_DIRECT is refused by some file systems (tmpfs, some overlays): fall back to buffered reads."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        buffer = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [buffer], 0)
        finally:
            buffer.close()
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class LatencyStats(TypedDict):
    """What a pattern's requests delivered: their count, bytes, rate and latency (None without requests)."""

    requests: int
    bytes: int
    seconds: float
    iops: float
    mb_per_s: float
    lat_mean_ms: float | None
    lat_p50_ms: float | None
    lat_p99_ms: float | None


def latency_stats(latencies: list[float] | np.ndarray, nbytes: int, seconds: float) -> LatencyStats:
    lat = np.asarray(latencies) * 1000.0
    requests = len(lat)
    return LatencyStats(requests=requests, bytes=nbytes, seconds=seconds,
                        iops=requests / seconds if seconds > 0 else 0.0,
                        mb_per_s=nbytes / seconds / 1e6 if seconds > 0 else 0.0,
                        lat_mean_ms=float(lat.mean()) if requests else None,
                        lat_p50_ms=float(np.percentile(lat, 50)) if requests else None,
                        lat_p99_ms=float(np.percentile(lat, 99)) if requests else None)


def _thread_loop(make_reader: Callable[[], Reader], files: list[File], pick: Picker, seed: int, quota: int,
                 times: Callable[[], tuple[float, float]]) -> tuple[list[int], int, float]:
    """One reader thread: requests from `times()`'s start until its end or `quota`; (latencies in ns,
    bytes read, end time)."""
    reader = make_reader()
    rng = np.random.default_rng(seed)
    try:
        fast = reader.native_batch(files)
        t_start, t_end = times()
        sleep_until(t_start)
        if fast is not None:
            return _native_loop(reader, fast, pick, rng, quota, int(t_end * 1e9))
        return _python_loop(reader, files, pick, rng, quota, int(t_end * 1e9))
    finally:
        reader.close()


def _native_loop(reader: Reader, fast: tuple[np.ndarray, memoryview], pick: Picker, rng: np.random.Generator,
                 quota: int, end_ns: int) -> tuple[list[int], int, float]:
    """Batches of reads issued and timed in C, the GIL released for each batch."""
    assert native is not None  # native_batch returned the fast path
    fds, buffer = fast
    parts: list[np.ndarray] = []
    nbytes, count, ended = 0, 0, time.perf_counter_ns()
    try:
        while count < quota and ended < end_ns:
            chosen, offsets, lengths = pick(rng, min(1024, quota - count))
            latencies = np.empty(len(chosen), np.int64)
            done, got, ended, error = native.timed_reads(fds[chosen], offsets.astype(np.int64),
                                                         lengths.astype(np.int64), buffer, latencies, end_ns,
                                                         reader.direct)
            parts.append(latencies[:done])
            nbytes, count = nbytes + got, count + done
            if error:
                raise OSError(error, os.strerror(error))
    finally:
        buffer.release()
    return np.concatenate(parts).tolist() if parts else [], nbytes, ended / 1e9


def _python_loop(reader: Reader, files: list[File], pick: Picker, rng: np.random.Generator, quota: int,
                 end_ns: int) -> tuple[list[int], int, float]:
    latencies: list[int] = []
    nbytes, count, ended = 0, 0, time.perf_counter()
    clock, read = time.perf_counter_ns, reader.read
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
    return latencies, nbytes, ended


Agree = Callable[[], tuple[float, float]]  # once every reader is ready: (start, end) on perf_counter
_READY_TIMEOUT_S = 120.0  # a reader process that never gets ready (killed, stuck forking) fails the pattern


def _threads(make_reader: Callable[[], Reader], files: list[File], pick: Picker, threads: int, seed: int,
             quota: int, agree: Agree) -> tuple[list[int], int, float, float]:
    """`threads` reader threads in this process; their latencies, bytes, the start and the last end time.
    The threads wait for each other (readers made, descriptors open) before `agree` sets the clock,
    so a slow start (a fork under load) cannot eat into the measured time."""
    out: list[tuple[list[int], int, float] | None] = [None] * threads
    errors: list[BaseException] = []
    clock: list[tuple[float, float]] = []
    gate = threading.Barrier(threads, action=lambda: clock.append(agree()), timeout=_READY_TIMEOUT_S)

    def times() -> tuple[float, float]:
        gate.wait()
        return clock[0]

    def run(index: int) -> None:
        try:
            out[index] = _thread_loop(make_reader, files, pick, seed * 1009 + index, quota, times)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)
            gate.abort()  # the others stop waiting for this one

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    done = [o for o in out if o is not None]
    return ([v for lat, _, _ in done for v in lat], sum(n for _, n, _ in done), clock[0][0],
            max(e for _, _, e in done))


def _starting_now(duration_s: float) -> Agree:
    def agree() -> tuple[float, float]:
        start = time.perf_counter() + 0.002  # the threads' wake-up from the barrier
        return start, start + duration_s
    return agree


def _process_main(queue: Any, ready: Any, shared: Any, make_reader: Callable[[], Reader], files: list[File],
                  pick: Picker, threads: int, seed: int, quota: int) -> None:
    def agree() -> tuple[float, float]:  # every process ready: the parent sets the clock for all
        ready.wait(_READY_TIMEOUT_S)
        ready.wait(_READY_TIMEOUT_S)
        return shared[0], shared[1]

    try:
        lat, nbytes, started, ended = _threads(make_reader, files, pick, threads, seed, quota, agree)
        queue.put((np.asarray(lat, dtype=np.int64), nbytes, started, ended, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as text
        ready.abort()
        queue.put((None, 0, 0.0, 0.0, f"{type(exc).__name__}: {exc}"))


def run_concurrent(make_reader: Callable[[], Reader], files: list[File], pick: Picker, concurrency: int,
                    processes: int, duration_s: float, max_requests: int, seed: int) -> LatencyStats:
    """`concurrency` readers for `duration_s`, as threads spread over `processes` forked processes
    (one process: threads here). Python threads share one GIL: past ~8 readers of small blocks the
    interpreter, not the storage, would be the limit, so local patterns spread them over the cores.
    Every reader starts at once, after all are ready; the time runs from that start to the last end."""
    quota = max(1, -(-max_requests // concurrency))
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    if processes == 1:
        lat, nbytes, started, ended = _threads(make_reader, files, pick, concurrency, seed, quota,
                                               _starting_now(duration_s))
        latencies = np.asarray(lat, dtype=np.int64)
    else:
        context = multiprocessing.get_context("fork")
        queue, ready = context.Queue(), context.Barrier(processes + 1)
        shared = context.Array("d", 2, lock=False)
        procs = [context.Process(target=_process_main, daemon=True,
                                 args=(queue, ready, shared, make_reader, files, pick, share, seed * 7919 + i, quota))
                 for i, share in enumerate(shares)]
        for proc in procs:
            proc.start()
        try:
            ready.wait(_READY_TIMEOUT_S)
            started = time.perf_counter() + 0.005  # the processes' wake-up from the barrier
            shared[0], shared[1] = started, started + duration_s
            ready.wait(_READY_TIMEOUT_S)
        except threading.BrokenBarrierError:
            pass  # a process failed before it was ready: its report below says why
        parts = [queue.get() for _ in procs]
        for proc in procs:
            proc.join()
        failed = next((p[4] for p in parts if p[4] is not None), None)
        if failed is not None:
            raise OSError(failed)
        latencies = np.concatenate([p[0] for p in parts])
        nbytes, ended = sum(p[1] for p in parts), max(p[3] for p in parts)
    return latency_stats(latencies / 1e9, nbytes, max(ended - started, 1e-9))


def processes_for(concurrency: int, local: bool) -> int:
    """Forked processes for a pattern: local reads only (remote clients hold threads and event loops
    that do not survive a fork), about 8 readers a process, at most two processes a core."""
    if not local or concurrency < 16 or not hasattr(os, "fork"):
        return 1
    cores = usable_cores()
    return max(1, min(2 * cores, concurrency // 8))
