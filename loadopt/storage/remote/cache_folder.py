"""The folder of a bounded local cache of remote files (the shard cache): whole copies, the least
recently used out first, its total kept at or below a limit, shared by every thread and process of the
machine that reads the same dataset.

Layout of the folder:
- `lock`: held (`flock`, exclusive) around every change of what the folder holds or has promised: reserving
  room for a copy (and evicting for it), publishing a copy, removing a dead fetch's temporary file;
- `files/<entry>`: complete copies; a copy's modification time is its last use, so the recency is the
  folder's and every process evicts by it;
- `tmp/<entry>.<pid>.<size>.tmp`: a copy being fetched, `flock`ed exclusively by its fetcher from its creation
  until it is renamed into `files/`; its name reserves `size` bytes of the limit. A temporary file that no
  process holds is a dead fetch's (its process was killed): the next reservation removes it.
A reader holds a shared `flock` on a copy while it reads it, and eviction takes only copies it can lock
exclusively at once, so a copy being read, by any process, is never evicted; a copy evicted between a
reader's `open` and its lock has no link left, which the reader takes as a miss.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

LOCK, FILES, TEMPS, SUFFIX = "lock", "files", "tmp", ".tmp"


@dataclass(frozen=True)
class Reservation:
    """Room reserved for one copy: its temporary file, open for writing and locked by this fetch."""

    entry: str
    temp: Path
    fd: int
    size: int


@dataclass(frozen=True)
class Refused:
    """Why no room was reserved: the copy is there, another fetch of it is under way (`temp`), the file is
    larger than the limit, or the room would take evicting copies that may not go (in use, or kept)."""

    why: Literal["cached", "busy", "too_large", "no_room"]
    temp: Path | None = None


def _no_count(**counts: int) -> None:
    pass


def let_go(fd: int) -> None:
    """Unlock, then close: a forked child holds a copy of every descriptor open at the fork, and a lock let go
    by closing alone would stay held by that copy (a DataLoader worker would keep a reader waiting for ever)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


_GONE = -1  # `_claim`: the file is not there


def _claim(path: Path) -> int | None:
    """`path` opened and locked exclusively (nobody reads or writes it); None when somebody holds it, `_GONE`
    when it is not there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return _GONE
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        let_go(fd)
        return None
    return fd


def _mark_used(fd: int) -> None:
    # Stated to the nanosecond: a plain touch takes the kernel's coarse clock, which ties uses a few ms apart.
    now = time.time_ns()
    os.utime(fd, ns=(now, now))


class CacheFolder:
    """The copies in `folder`, at most `limit` bytes in all (`count` is told of evictions and dead fetches)."""

    def __init__(self, folder: Path, limit: int, count: Callable[..., None] = _no_count) -> None:
        self.folder, self.limit, self.count = Path(folder), int(limit), count

    def ensure(self) -> None:
        (self.folder / FILES).mkdir(parents=True, exist_ok=True)
        (self.folder / TEMPS).mkdir(exist_ok=True)

    def copy(self, entry: str) -> Path:
        return self.folder / FILES / entry

    def temp(self, entry: str, pid: int, size: int) -> Path:
        return self.folder / TEMPS / f"{entry}.{pid}.{size}{SUFFIX}"

    def has(self, entry: str) -> bool:
        return self.copy(entry).exists()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The folder's lock; a fresh open description per holder, so threads exclude each other as processes do."""
        fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            let_go(fd)

    def open_copy(self, entry: str) -> int | None:
        """The copy of `entry` open for reading, share-locked (close it to let it go) and marked used now;
        None when there is none."""
        try:
            fd = os.open(self.copy(entry), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink == 0:  # evicted between the open and the lock
                let_go(fd)
                return None
            with contextlib.suppress(OSError):  # a copy another user made: its recency stays theirs
                _mark_used(fd)
        except BaseException:
            let_go(fd)
            raise
        return fd

    def used(self) -> int:
        """Bytes the folder holds or has promised: its files, and each live fetch's reserved size."""
        return self._used(self._live_temps())

    def reserve(self, entry: str, size: int, keep: Collection[str] = (), evict: bool = True) -> Reservation | Refused:
        """Room for the copy of `entry` (`size` bytes), evicting the least recently used copies other than
        `keep` and those in use, all or none of them (`evict=False`: none, only room already free); dead fetches'
        temporary files are removed first."""
        self.ensure()  # the folder may have been removed while the job ran (a cache cleaned by hand)
        with self.locked():
            live = self._live_temps()
            busy = next((path for path, (owner, _) in live.items() if owner == entry), None)
            if busy is not None:
                return Refused("busy", busy)
            if self.has(entry):
                return Refused("cached")
            if size > self.limit:
                return Refused("too_large")
            need = self._used(live) + size - self.limit
            if need > 0 and not (evict and self._evict(need, keep)):
                return Refused("no_room")
            temp = self.temp(entry, os.getpid(), size)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)  # under the folder's lock: no one sees it unlocked while it lives
            return Reservation(entry, temp, fd, size)

    def publish(self, reservation: Reservation) -> None:
        """The fetched temporary file renamed into place as the copy, used now."""
        try:
            os.fsync(reservation.fd)  # the copy is never a name over bytes still to reach the disk
            with self.locked():
                os.replace(reservation.temp, self.copy(reservation.entry))
                _mark_used(reservation.fd)
        except BaseException:
            self.abandon(reservation)
            raise
        let_go(reservation.fd)

    def abandon(self, reservation: Reservation) -> None:
        """A fetch given up: its temporary file removed, its room given back."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(reservation.temp)
        with contextlib.suppress(OSError):
            let_go(reservation.fd)

    def wait(self, temp: Path) -> None:
        """Until the fetch writing `temp` has ended (published, given up, or its process gone)."""
        try:
            fd = os.open(temp, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            let_go(fd)

    def _live_temps(self) -> dict[Path, tuple[str, int]]:
        """(entry, reserved bytes) of each fetch under way; dead ones' files removed (under the lock)."""
        live: dict[Path, tuple[str, int]] = {}
        for name in os.listdir(self.folder / TEMPS):
            path = self.folder / TEMPS / name
            parts = name[: -len(SUFFIX)].rsplit(".", 2) if name.endswith(SUFFIX) else []
            if len(parts) != 3 or not parts[2].isdigit():
                continue  # not one of ours
            fd = _claim(path)
            if fd == _GONE:
                continue
            if fd is None:
                live[path] = (parts[0], int(parts[2]))
                continue
            try:  # nobody holds it: its fetch died
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self.count(dead_temps=1)
            finally:
                let_go(fd)
        return live

    def _used(self, live: dict[Path, tuple[str, int]]) -> int:
        total = sum(size for _, size in live.values())
        for folder in (self.folder, self.folder / FILES):
            with os.scandir(folder) as entries:
                for item in entries:
                    with contextlib.suppress(FileNotFoundError):
                        if item.is_file(follow_symlinks=False):
                            total += item.stat(follow_symlinks=False).st_size
        return total

    def _evict(self, need: int, keep: Collection[str]) -> bool:
        """Remove the least recently used copies not in `keep` and not in use until `need` bytes are free;
        False, and nothing removed, when those copies hold too little."""
        found = []
        with os.scandir(self.folder / FILES) as entries:
            for item in entries:
                if item.name not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        stat = item.stat(follow_symlinks=False)
                        found.append((stat.st_mtime_ns, item.name, stat.st_size))
        chosen: list[tuple[int, Path, int]] = []
        freed = 0
        try:
            for _, name, size in sorted(found):
                if freed >= need:
                    break
                path = self.folder / FILES / name
                fd = _claim(path)
                if fd is None or fd == _GONE:  # being read right now, or gone
                    continue
                chosen.append((fd, path, size))
                freed += size
            if freed < need:
                return False
            for _, path, size in chosen:
                os.unlink(path)
                self.count(evicted_files=1, evicted_bytes=size)
            return True
        finally:
            for fd, _, _ in chosen:
                let_go(fd)
