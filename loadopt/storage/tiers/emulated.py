"""The emulated tier: a wrapper filesystem that reads a real one under a tier's limits and faults.

Each read request (a whole file or a byte range):
1. takes one of `max_concurrency` slots (a concurrency/IOPS cap), held until the request completes;
2. waits its latency (fixed, or drawn from an exponential or lognormal distribution of that mean);
   the real read runs inside this time, so the figures are the tier's whenever the real storage is
   faster than the emulated one;
3. may fail (an injected I/O error after the latency) or hang (`timeout_s`, then a timeout);
4. reserves its transfer on the tier's bandwidth clock: a virtual clock of when the tier's pipe is
   next free (a token bucket without burst), so all readers together get `bandwidth_mb_s`.
   A real read that ends after the time the tier's figures give the request is counted (`base_over_s`):
   the emulation can only slow the storage under it down, so those requests are the base's, not the tier's.
Transient errors are retried with capped exponential backoff (`read_with_retries`) and counted.

The limits hold for the tier as a whole, across threads and processes (forked DataLoader workers,
spawned consumers): the clock and the counters live in a small file mapped shared (in /dev/shm when
there is one), updated under `flock`; the slots are `flock`s on one file each, booked in arrival
order on a virtual clock (`SharedTierState`). The state folder travels with the filesystem when
it is pickled, so a spawned process joins the same tier. Sleeping is the emulated device's time:
every sleep is computed from the tier's figures.
"""

from __future__ import annotations

import math
import os
import pickle
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from loadopt.clock import sleep_until
from loadopt.storage.remote.access import display_name, read_with_retries
from loadopt.storage.tiers.state import COUNTERS, SharedTierState, remove_state, state_root

if TYPE_CHECKING:  # the tier stack imports this module where it makes a tier
    from loadopt.storage.tiers.spec import TierSpec

__all__ = ["COUNTERS", "EmulatedFileSystem", "InjectedReadError", "InjectedTimeout", "SharedTierState"]

_LOGNORMAL_SIGMA = 0.5  # spread of lognormal latencies (the mean is latency_ms)


class InjectedReadError(OSError):
    """An I/O error the emulated tier injected (transient: retried)."""


class InjectedTimeout(TimeoutError):
    """A request the emulated tier let hang until its timeout (transient: retried)."""


class EmulatedFileSystem(fsspec.AbstractFileSystem):
    """`base_fs` read under the limits of tier `spec`; listing is passed through.

    Read-only. Paths are `base_fs`'s own. `state_dir` and `owner_pid` are set when unpickled in
    another process (the same tier instance); leave them out to make a new instance."""

    protocol = "loadopt-tier"
    cachable = False  # every instance is its own tier (its own clock, slots and counters)
    root_marker = ""

    def __init__(self, spec: TierSpec, base_fs: fsspec.AbstractFileSystem, state_dir: str | None = None,
                 owner_pid: int | None = None, **kwargs: Any) -> None:
        from loadopt.storage.tiers.spec import TierSpec

        super().__init__(**kwargs)
        self.spec = TierSpec.model_validate(spec)
        self._base, self._base_pid = base_fs, os.getpid()
        if state_dir is None:
            state_dir, owner_pid = str(state_root() / uuid.uuid4().hex), os.getpid()
            weakref.finalize(self, remove_state, state_dir, owner_pid)
        self.state = SharedTierState(state_dir, self.spec.max_concurrency)
        self.state_dir = state_dir

    @property
    def base_fs(self) -> fsspec.AbstractFileSystem:
        """The real filesystem; a fresh instance in a forked process (async clients such as aiohttp's and
        aiobotocore's are bound to the parent's event loop and refuse to run after a fork)."""
        if self._base_pid != os.getpid():
            self._base, self._base_pid = pickle.loads(pickle.dumps(self._base)), os.getpid()
        return self._base

    def __reduce__(self):  # pickled by reference to this instance's state: other processes join the same tier
        return type(self), (self.spec, self.base_fs, self.state_dir, -1)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path  # paths are the base filesystem's own

    def unstrip_protocol(self, name: str) -> str:
        return self.base_fs.unstrip_protocol(name)

    def counters(self) -> dict[str, float]:
        return self.state.counters()

    # --- listing: passed through -----------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any):
        return self.base_fs.ls(path, detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.base_fs.info(path, **kwargs)

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs):
        return self.base_fs.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self.base_fs.exists(path, **kwargs)

    def isdir(self, path: str) -> bool:
        return self.base_fs.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.base_fs.isfile(path)

    def size(self, path: str) -> int | None:
        return self.base_fs.size(path)

    # --- reads: through the tier ------------------------------------------------------------------
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        # Each attempt arrives at the tier as it starts: the tier's own work before its booking (the latency
        # draw, the booking's lock and its wait for the GIL) then runs inside the request's modeled time, not
        # after it (on a busy machine that work kept readers from asking in time: 0.75 of a 2 ms x8 cap).
        return read_with_retries(lambda: self._request(path, start, end, time.monotonic()), self.spec.retry,
                                 lambda: display_name(self.base_fs, path),
                                 on_retry=lambda exc: self.state.add(retries=1),
                                 on_failure=lambda exc: self.state.add(failed_reads=1))

    def _request(self, path: str, start: int | None, end: int | None, arrival: float) -> bytes:
        spec, state = self.spec, self.state
        latency = self._latency_s()
        # The slot's flock is held for the real read only; the tier's time is its booking (the slot is
        # booked until `done`), waited out after letting the flock go. Holding the flock through the
        # wait made the next request on the slot wait for this thread to wake up before its own service
        # could start: two wake-ups in a row per request, a third of the cap on a busy machine.
        with state.slot(arrival, latency) as (began, releases_at, add):
            ready = done = began + latency
            draw = state.rng.random()
            if draw < spec.error_rate + spec.timeout_rate:  # an injected fault: no read
                if draw >= spec.error_rate:
                    done = began + spec.timeout_s
                releases_at(done)
            else:
                releases_at(ready)
                try:
                    data = self._read(path, start, end)
                except Exception:
                    add(requests=1, errors=1)
                    raise
                if spec.bandwidth_mb_s is not None:
                    done = state.reserve_transfer(len(data), ready, spec.bandwidth_mb_s * 1e6)
                    releases_at(done)
                # counted before the wait, so that the bookkeeping hides inside the tier's time; a real read
                # that ends after `done` is the base's time, not the tier's: the emulation can only slow it
                read_end = time.monotonic()
                add(requests=1, bytes=len(data), throttle_s=max(0.0, done - read_end),
                    request_s=max(done, read_end) - arrival, base_over_s=max(0.0, read_end - done))
        if draw < spec.error_rate:
            sleep_until(done, clock=time.monotonic)
            state.add(requests=1, errors=1, injected_errors=1)
            raise InjectedReadError(5, "injected read error (emulated tier)", path)
        if draw < spec.error_rate + spec.timeout_rate:
            sleep_until(done, clock=time.monotonic)
            state.add(requests=1, errors=1, injected_timeouts=1)
            raise InjectedTimeout(f"{path}: no answer in {spec.timeout_s:g} s (emulated tier)")
        sleep_until(done, clock=time.monotonic)
        return data

    def _read(self, path: str, start: int | None, end: int | None) -> bytes:
        """The real read, under the slot (a read that hangs, even in its open, holds its slot): on the
        local disk with system calls (fsspec's local file object added a large share of a capped request's
        CPU), elsewhere the base's `cat_file` (the range cut from a whole file where the server ignored it)."""
        base = self.base_fs
        if type(base) is not LocalFileSystem:  # a subclass may read its own way
            data = base.cat_file(path, start=start, end=end)
            if start is not None and end is not None and 0 <= start <= end <= len(data) and len(data) > end - start:
                # an HTTP server without Range support answers 200 with the whole file, as fsspec passes it on
                return data[start:end]
            return data
        fd = os.open(base._strip_protocol(path), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            first = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
            last = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
            return os.pread(fd, last - first, first) if last > first else b""
        finally:
            os.close(fd)

    def _latency_s(self) -> float:
        mean = self.spec.latency_ms / 1000.0
        if mean <= 0 or self.spec.latency_distribution == "fixed":
            return mean
        rng = self.state.rng
        if self.spec.latency_distribution == "exponential":
            return rng.expovariate(1.0 / mean)
        # lognormal with this mean: mu = ln(mean) - sigma^2 / 2
        return rng.lognormvariate(math.log(mean) - _LOGNORMAL_SIGMA ** 2 / 2, _LOGNORMAL_SIGMA)

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None, autocommit: bool = True,
              cache_options: dict | None = None, **kwargs: Any):
        if mode != "rb":
            raise PermissionError(f"{path}: a storage tier is read-only")
        return _TierFile(self, path, mode, block_size or "default", cache_options=cache_options, **kwargs)


class _TierFile(AbstractBufferedFile):
    """A file read in byte ranges through the tier (each range is one request)."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start=start, end=end)
