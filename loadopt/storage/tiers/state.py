"""The shared state of an emulated tier (`EmulatedFileSystem`): its bandwidth clock, counters and
concurrency slots, one instance across threads and processes, and the precise sleeps its times are.

The clock and the counters live in a small file mapped shared (in /dev/shm when there is one),
updated under `flock`; the slots are `flock`s on one file each, booked in arrival order on a virtual
clock (see `SharedTierState.slot`). A forked child opens its own descriptors (flocks belong to open
descriptions); a spawned process joins by the folder's path.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import random
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from loadopt.clock import sleep_until

COUNTERS = ("requests", "bytes", "retries", "errors", "injected_errors", "injected_timeouts", "failed_reads",
            "throttle_s", "request_s", "base_over_s")
# Seconds, kept as floats: the rest are counts. `request_s` sums the reads' times from arrival to their end;
# `base_over_s` the part of it the storage under the tier took past the end the tier's figures gave them.
TIMES = ("throttle_s", "request_s", "base_over_s")
_CLOCK = 0  # the state file's first value; the counters start at index 2 (1 is unused)
# From here on, one value per slot: when its holder expects to release it; then one per slot: when the
# last request booked on it is due to end (the end of its queue); then the counters of each slot, updated
# by the slot's holder under the slot's flock (no second pass through the state's lock per request).
SLOT_RELEASES = 64
_BLOCK_WITHIN_S = 0.002  # a request wakes this long before its turn and blocks on its slot's flock


# Serialises first use per process (two threads attaching at once would get two thread locks); a fresh
# one in a forked child, where the parent's could be held by a thread that does not exist there.
_ATTACH_LOCK = threading.Lock()


def _fresh_attach_lock() -> None:
    global _ATTACH_LOCK
    _ATTACH_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_attach_lock)

# Every attached state of this process: a forked child closes its copies of the parent's slot handles
# (an inherited copy of an open description would keep a dead parent's flock held, and an unlock
# through it would release the parent's), and opens its own.
_STATES: weakref.WeakSet[SharedTierState] = weakref.WeakSet()


def _forget_handles() -> None:
    for state in list(_STATES):
        handles = getattr(state, "_pool", None)
        if handles is not None:
            state._pool = _SlotHandles(handles.folder, len(handles.free))
            handles.close_all()


os.register_at_fork(after_in_child=_forget_handles)


def state_root() -> Path:
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
        state_bytes = -(-8 * (SLOT_RELEASES + (2 + len(COUNTERS)) * (self.slots or 0)) // 4096) * 4096
        if os.fstat(fd).st_size < state_bytes:
            os.ftruncate(fd, state_bytes)  # zero-filled: clock 0, counters 0, every slot released long ago
        self._fd = fd
        self._map = mmap.mmap(fd, state_bytes, mmap.MAP_SHARED)
        self._values = memoryview(self._map).cast("d")
        self._thread_lock = threading.Lock()
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._pool = _SlotHandles(self.folder, self.slots or 0)  # open descriptions of the slot files, per slot
        _STATES.add(self)
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
        """The tier's counters: the state's own and every slot's, summed."""
        slots, width = self.slots or 0, len(COUNTERS)
        with self._locked() as values:
            first = SLOT_RELEASES + 2 * slots
            totals = [values[2 + i] + sum(values[first + k * width + i] for k in range(slots))
                      for i in range(width)]
        return {name: (totals[i] if name in TIMES else int(totals[i])) for i, name in enumerate(COUNTERS)}

    def reserve_transfer(self, nbytes: int, earliest: float, bytes_per_s: float) -> float:
        """Book `nbytes` on the tier's pipe no earlier than `earliest`; returns when the transfer ends."""
        with self._locked() as values:
            start = max(earliest, values[_CLOCK])
            end = start + nbytes / bytes_per_s
            values[_CLOCK] = end
            return end

    @contextmanager
    def slot(self, arrival: float, hold_s: float = 0.0) -> Iterator[tuple[float, Callable[[float], None],
                                                                           Callable[..., None]]]:
        """Hold one of the tier's concurrency slots for about `hold_s` (no-op without a cap). Yields
        (when the request's service began, `releases_at(t)`, `add(**counts)`): `arrival` when it did not
        queue, so that taking a free slot costs the request none of its latency; a function for the holder
        to say when it will let the slot go (a monotonic time) when that is later than `arrival + hold_s`;
        and one that adds to the tier's counters under the slot's flock (without a cap: the state's lock).

        A request reserves its turn as it arrives, under the state's lock: the slot whose queue ends
        first, from the end of that queue (a virtual clock, like the bandwidth's: FIFO over the whole
        tier, and no slot idles while a request waits). It then waits for its turn and for the slot's
        flock (its last holder really letting go). Service begins at the reserved time, not when this
        thread got round to it, so wake-ups and bookkeeping do not eat into the tier's IOPS; never
        after now (a holder killed early said a release still to come), and not before the slot's last
        holder said it would let go. (A `door` flock that one waiter at a time held while it waited for a
        slot made every hand-over two thread wake-ups in a row: on a busy machine 2 ms x8 delivered a
        third of its cap.) flocks end with their process, so a killed DataLoader worker never keeps a slot."""
        if not self.slots:
            yield arrival, _no_release_hint, self.add
            return
        self._attach()  # creates the state folder in a process that has not touched the tier yet
        releases = self._values[SLOT_RELEASES:SLOT_RELEASES + self.slots]
        tails = self._values[SLOT_RELEASES + self.slots:SLOT_RELEASES + 2 * self.slots]
        handles = self._pool
        with self._locked():
            taken = min(range(self.slots), key=tails.__getitem__)
            began = max(arrival, tails[taken])
            booked = tails[taken] = began + hold_s
        # Wake just before the turn (a request booked behind another on the same slot does not race it
        # for the flock), then block on the flock: the kernel wakes us as the last holder lets go.
        sleep_until(began - _BLOCK_WITHIN_S, clock=time.monotonic)
        fd = handles.take(taken)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:  # interrupted while waiting: the description goes back unlocked
            handles.give(taken, fd)
            raise
        try:
            began = max(began, min(releases[taken], time.monotonic()))
            releases[taken] = math.inf  # said by the holder once it knows

            def releases_at(when: float) -> None:
                releases[taken] = when
                if when > booked:  # longer than booked: the requests booked after it move back
                    with self._locked():
                        tails[taken] = max(tails[taken], when)

            counts = self._values[SLOT_RELEASES + 2 * self.slots + taken * len(COUNTERS):][:len(COUNTERS)]

            def add(**values: float) -> None:
                for name, value in values.items():
                    counts[COUNTERS.index(name)] += value

            yield began, releases_at, add
        finally:
            if releases[taken] == math.inf:  # it never said (an error before it knew): released now
                releases[taken] = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_UN)
            handles.give(taken, fd)


class _SlotHandles:
    """This process's open descriptions of the slot files, pooled per slot: flocks conflict between open
    descriptions, so two requests holding one slot at once need two, and a request holds one slot. Opened
    on first need and kept (opening and closing per request cost more CPU than the rest of the request):
    at most as many per slot as requests ever held it at once. A set of every slot's file per concurrent
    request (as before) opened slots x threads descriptors: 825 x 64 > the open-file limit."""

    def __init__(self, folder: Path, slots: int) -> None:
        self.pid, self.folder = os.getpid(), folder
        self.free: list[list[int]] = [[] for _ in range(slots)]  # list.pop and append are atomic

    def take(self, slot: int) -> int:
        try:
            return self.free[slot].pop()
        except IndexError:
            return os.open(self.folder / f"slot-{slot}", os.O_RDWR | os.O_CREAT, 0o600)

    def give(self, slot: int, fd: int) -> None:
        self.free[slot].append(fd)

    def close_all(self, close: Callable[[int], None] = os.close) -> None:
        for fds in self.free:
            while fds:
                with suppress(OSError, IndexError):
                    close(fds.pop())

    # os's functions bound at definition: at interpreter exit the module may be gone before this runs
    def __del__(self, getpid: Callable[[], int] = os.getpid, close: Callable[[int], None] = os.close) -> None:
        if getattr(self, "pid", None) == getpid():  # a forked child's copies: closed at the fork
            self.close_all(close)


def _no_release_hint(when: float) -> None:
    pass


def remove_state(folder: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # forked children inherit the finalizer: only the creator cleans up
        shutil.rmtree(folder, ignore_errors=True)


