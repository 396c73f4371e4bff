"""The emulated tier: a wrapper filesystem that reads a real one under a tier's limits and faults.

Each read request (a whole file or a byte range):
1. takes one of `max_concurrency` slots (a concurrency/IOPS cap), held until the request completes;
2. waits its latency (fixed, or drawn from an exponential or lognormal distribution of that mean);
   the real read runs inside this time, so the figures are the tier's whenever the real storage is
   faster than the emulated one;
3. may fail (an injected I/O error after the latency) or hang (`timeout_s`, then a timeout);
4. reserves its transfer on the tier's bandwidth clock: a virtual clock of when the tier's pipe is
   next free (a token bucket without burst), so all readers together get `bandwidth_mb_s`.
Transient errors are retried with capped exponential backoff (storage/remote.py) and counted.

The limits hold for the tier as a whole, across threads and processes (forked DataLoader workers,
spawned consumers): the clock and the counters live in a small file mapped shared (in /dev/shm when
there is one), updated under `flock`; the slots are `flock`s on one file each, queued behind a `door`
flock. The state folder travels with the filesystem when it is pickled, so a spawned process joins the
same tier. Sleeping is the emulated device's time: every sleep is computed from the tier's figures.
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import mmap
import os
import pickle
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile

from loadopt.storage.remote import read_with_retries

COUNTERS = ("requests", "bytes", "retries", "errors", "injected_errors", "injected_timeouts", "failed_reads",
            "throttle_s")
_CLOCK = 0  # the state file's first value; the counters start at index 2 (1 is unused)
_PR_SET_TIMERSLACK = 29  # prctl option (linux/prctl.h)
_SLOT_RELEASES = 64  # from here on, one value per slot: when its holder expects to release it
_SLOT_POLL_S = 0.0002  # how soon the request at the door looks again when no holder has said yet
_BLOCK_WITHIN_S = 0.002  # a slot due this soon is waited for with a blocking flock
_LONGEST_WAIT_S = 0.05  # look again at least this often (a holder killed mid-request said a late time)
_LOGNORMAL_SIGMA = 0.5  # spread of lognormal latencies (the mean is latency_ms)


class InjectedReadError(OSError):
    """An I/O error the emulated tier injected (transient: retried)."""


class InjectedTimeout(TimeoutError):
    """A request the emulated tier let hang until its timeout (transient: retried)."""


# Serialises first use per process (two threads attaching at once would get two thread locks); a fresh
# one in a forked child, where the parent's could be held by a thread that does not exist there.
_ATTACH_LOCK = threading.Lock()


def _fresh_attach_lock() -> None:
    global _ATTACH_LOCK
    _ATTACH_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_attach_lock)


def _state_root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "loadopt-tiers"
    return Path(tempfile.gettempdir()) / "loadopt-tiers"


class SharedTierState:
    """The bandwidth clock, counters and concurrency slots of one tier instance.

    Safe across threads (a lock per process) and processes (`flock` on a descriptor opened by this
    process: descriptors inherited through fork share their lock, so each process opens its own)."""

    def __init__(self, folder: str | os.PathLike[str], slots: int | None) -> None:
        self.folder = Path(folder)
        self.slots = slots
        self._pid = -1

    def _attach(self) -> None:
        if self._pid == os.getpid():
            return
        with _ATTACH_LOCK:
            if self._pid != os.getpid():
                self._open_state()

    def _open_state(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / "state", os.O_RDWR | os.O_CREAT, 0o600)
        state_bytes = -(-8 * (_SLOT_RELEASES + (self.slots or 0)) // 4096) * 4096
        if os.fstat(fd).st_size < state_bytes:
            os.ftruncate(fd, state_bytes)  # zero-filled: clock 0, counters 0, every slot released long ago
        self._fd = fd
        self._map = mmap.mmap(fd, state_bytes, mmap.MAP_SHARED)
        self._values = memoryview(self._map).cast("d")
        self._thread_lock = threading.Lock()
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._pid = os.getpid()

    @contextmanager
    def _locked(self):
        self._attach()
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._values
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def rng(self) -> random.Random:
        self._attach()
        return self._rng

    def add(self, **counts: float) -> None:
        with self._locked() as values:
            for name, value in counts.items():
                values[2 + COUNTERS.index(name)] += value

    def counters(self) -> dict[str, float]:
        with self._locked() as values:
            return {name: (values[2 + i] if name == "throttle_s" else int(values[2 + i]))
                    for i, name in enumerate(COUNTERS)}

    def reserve_transfer(self, nbytes: int, earliest: float, bytes_per_s: float) -> float:
        """Book `nbytes` on the tier's pipe no earlier than `earliest`; returns when the transfer ends."""
        with self._locked() as values:
            start = max(earliest, values[_CLOCK])
            end = start + nbytes / bytes_per_s
            values[_CLOCK] = end
            return end

    @contextmanager
    def slot(self, arrival: float) -> Iterator[tuple[float, Callable[[float], None]]]:
        """Hold one of the tier's concurrency slots (no-op without a cap). Yields (when the request's
        service began, `releases_at(t)`): `arrival` when it did not queue, so that taking a free
        slot costs the request none of its latency; and a function for the holder to say when it
        expects to let the slot go (a monotonic time), which is also when the next request's service
        begins.

        Requests queue on one `door` flock; the one at the door takes the first slot that frees: it
        sleeps until shortly before the earliest release a holder announced, then blocks on that
        slot. No slot idles while a request waits. (A queue per slot let one queue run dry while the
        other still had waiters: up to 15% fewer IOPS than the cap.) flocks end with their process,
        so a killed DataLoader worker never keeps a slot or the door."""
        if not self.slots:
            yield arrival, _no_release_hint
            return
        self._attach()  # creates the state folder in a process that has not touched the tier yet
        releases = self._values[_SLOT_RELEASES:_SLOT_RELEASES + self.slots]
        door = os.open(self.folder / "door", os.O_RDWR | os.O_CREAT, 0o600)
        opened: dict[int, int] = {}
        taken = None
        try:
            fcntl.flock(door, fcntl.LOCK_EX)
            taken = self._first_free_slot(opened, releases)
            # Service begins when the slot was due to free (its last holder's announced release), not
            # when this thread got round to taking it: a virtual clock, like the bandwidth's, so that
            # wake-ups and bookkeeping do not eat into the tier's IOPS. Never before arrival, never
            # after now (a holder killed early announced a release still to come).
            began = max(arrival, min(releases[taken], time.monotonic()))
            releases[taken] = math.inf  # announced by the holder once it knows
        finally:
            os.close(door)  # the next request in the queue may look for a slot now
            for k, fd in opened.items():
                if k != taken:
                    os.close(fd)

        def releases_at(when: float) -> None:
            releases[taken] = when

        try:
            yield began, releases_at
        finally:
            if releases[taken] == math.inf:  # it never said (an error before it knew): released now
                releases[taken] = time.monotonic()
            os.close(opened[taken])  # closing the only descriptor of its open file releases the flock

    def _first_free_slot(self, opened: dict[int, int], releases: memoryview) -> int:
        """Wait for a slot and take it (its flock held on `opened[slot]`); called at the door."""
        while (taken := self._try_slots(opened, releases)) is None:
            first = min(range(self.slots), key=releases.__getitem__)
            wait = releases[first] - time.monotonic()
            if wait < _BLOCK_WITHIN_S:  # due now: block on it, the kernel wakes us as it is let go
                fcntl.flock(opened[first], fcntl.LOCK_EX)
                return first
            # wake just inside the blocking window (or poll while every holder is yet to announce)
            _precise_sleep(min(wait - _BLOCK_WITHIN_S / 2, _LONGEST_WAIT_S) if wait != math.inf else _SLOT_POLL_S)
        return taken

    def _try_slots(self, opened: dict[int, int], releases: memoryview) -> int | None:
        """The first slot free, tried in the order their holders said they would release them."""
        for k in sorted(range(self.slots), key=releases.__getitem__):
            if k not in opened:
                opened[k] = os.open(self.folder / f"slot-{k}", os.O_RDWR | os.O_CREAT, 0o600)
            if _try_flock(opened[k]):
                return k
        return None


def _no_release_hint(when: float) -> None:
    pass


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _remove_state(folder: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # forked children inherit the finalizer: only the creator cleans up
        shutil.rmtree(folder, ignore_errors=True)


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        _precise_sleep(delay)


_thread_timers = threading.local()


def _precise_sleep(seconds: float) -> None:
    """`time.sleep` with this thread's timer slack at 1 µs (Linux wakes a sleeper up to 50 µs late by
    default: about 80 µs late per sleep measured here, 27 µs at 1 µs slack). Emulated latencies are
    sleeps, so the slack was a 10% error on a 1 ms tier."""
    if not getattr(_thread_timers, "tight", False):
        _thread_timers.tight = True
        if sys.platform.startswith("linux"):
            with suppress(OSError, AttributeError):  # no prctl: the default slack it is
                ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    time.sleep(seconds)


class EmulatedFileSystem(fsspec.AbstractFileSystem):
    """`base_fs` read under the limits of tier `spec` (a TierSpec as a dict); listing is passed through.

    Read-only. Paths are `base_fs`'s own. `state_dir` and `owner_pid` are set when unpickled in
    another process (the same tier instance); leave them out to make a new instance."""

    protocol = "loadopt-tier"
    cachable = False  # every instance is its own tier (its own clock, slots and counters)
    root_marker = ""

    def __init__(self, spec: dict[str, Any], base_fs: fsspec.AbstractFileSystem, state_dir: str | None = None,
                 owner_pid: int | None = None, **kwargs: Any) -> None:
        from loadopt.storage.tiers import TierSpec

        super().__init__(**kwargs)
        self.spec = TierSpec(**spec)
        self._base, self._base_pid = base_fs, os.getpid()
        if state_dir is None:
            state_dir, owner_pid = str(_state_root() / uuid.uuid4().hex), os.getpid()
            weakref.finalize(self, _remove_state, state_dir, owner_pid)
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
        return type(self), (self.spec.model_dump(mode="json"), self.base_fs, self.state_dir, -1)

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
        return read_with_retries(lambda: self._request(path, start, end), self.spec.retry, path,
                                 on_retry=lambda exc: self.state.add(retries=1),
                                 on_failure=lambda exc: self.state.add(failed_reads=1))

    def _request(self, path: str, start: int | None, end: int | None) -> bytes:
        spec, state = self.spec, self.state
        with state.slot(time.monotonic()) as (began, releases_at):
            ready = began + self._latency_s()
            releases_at(ready)
            draw = state.rng.random()
            if draw < spec.error_rate:
                _sleep_until(ready)
                state.add(requests=1, errors=1, injected_errors=1)
                raise InjectedReadError(5, "injected read error (emulated tier)", path)
            if draw < spec.error_rate + spec.timeout_rate:
                releases_at(began + spec.timeout_s)
                _sleep_until(began + spec.timeout_s)
                state.add(requests=1, errors=1, injected_timeouts=1)
                raise InjectedTimeout(f"{path}: no answer in {spec.timeout_s:g} s (emulated tier)")
            try:
                data = self.base_fs.cat_file(path, start=start, end=end)
            except Exception:
                state.add(requests=1, errors=1)
                raise
            done = ready
            if spec.bandwidth_mb_s is not None:
                done = state.reserve_transfer(len(data), ready, spec.bandwidth_mb_s * 1e6)
                releases_at(done)
            # counted before the wait, so that the bookkeeping hides inside the tier's time
            state.add(requests=1, bytes=len(data), throttle_s=max(0.0, done - time.monotonic()))
            _sleep_until(done)
        return data

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
