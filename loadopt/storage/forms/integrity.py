"""What keeps a cached conversion honest: chunk checksums, the source's content digest, temporary
files that a killed conversion left, files created with the user's umask, and a full disk said in
one line.

Checksums are CRC-32 (zlib: in the standard library, and fast beside the reads it checks; neither crc32c
nor xxhash is a dependency) over chunks of `CHUNK_BYTES`. A conversion stores them beside its data (the
Arrow form in each record batch's custom metadata, the raw form in its manifest's shard table), and the
manifest holds a CRC-32 of every other file the conversion consists of (a raw shard's index and frame
dims, an Arrow shard's outline: `files`). They are checked when the conversion is reused: all of them under
`loadopt convert --verify`, which reconverts a conversion found damaged (`DamagedConversion`); otherwise a
few chunks chosen at random and the other files of the shards they are in (a cheap sample: damage is found
over repeated uses, at once with --verify). A read between the sampled chunks is not checked: a flipped
byte there is delivered as it is, until --verify finds it.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np

from loadopt.errors import DatasetError, shown_name

CHUNK_BYTES = 4 << 20
ALGORITHM = "crc32"
SAMPLE_CHUNKS = 3  # chunks checked when a conversion is reused without --verify
Verify = Literal["none", "sample", "all"]


# ---------------------------------------------------------------------------------------------
# Checksums


def chunk_sums(data: memoryview | bytes) -> list[int]:
    """CRC-32 of each `CHUNK_BYTES` slice of `data` (one value for empty data)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[at:at + CHUNK_BYTES]) for at in range(0, max(len(view), 1), CHUNK_BYTES)]


class ChunkSums:
    """CRC-32 of each `CHUNK_BYTES` chunk of a stream written piece by piece (a raw shard)."""

    def __init__(self) -> None:
        self.sums: list[int] = []
        self._crc, self._filled = 0, 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHUNK_BYTES - self._filled)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == CHUNK_BYTES:
                self.sums.append(self._crc)
                self._crc, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled or not self.sums:
            self.sums.append(self._crc)
            self._crc, self._filled = 0, 0
        return self.sums


def chunks_to_check(count: int, verify: Verify, rng: random.Random | None = None) -> list[int]:
    """The chunk numbers (of `count`) that `verify` checks: all, a random few, or none."""
    if verify == "all":
        return list(range(count))
    if verify == "none" or count == 0:
        return []
    return sorted((rng or random.Random()).sample(range(count), min(SAMPLE_CHUNKS, count)))


class DamagedConversion(DatasetError):
    """A finished conversion's file missing, short, unreadable or not matching its checksum: what `loadopt convert
    --verify` reconverts, and what the loaders name in one line with the command that rebuilds it."""

    def finding(self) -> str:
        """The line without its advice (`rebuild_hint`): what --verify says before it reconverts."""
        line = str(self)
        for to in ("raw", "arrow"):
            for form in ("; {}", " ({})", ": {}", "{}"):
                line = line.replace(form.format(rebuild_hint(to)), "")
        return line.replace("()", "").rstrip(" ;:")


def rebuild_hint(to: str) -> str:
    """The advice closing a damaged conversion's line: the command that rebuilds the conversion `to` (raw, arrow)."""
    return f"run `loadopt convert CONFIG --to {to} --force` to rebuild it"


def damaged(where: str, to: str) -> DamagedConversion:
    """The one-line error for a chunk or file of the conversion `to` (raw, arrow) whose checksum does not match."""
    return DamagedConversion(f"{where}: checksum mismatch: the converted file is damaged ({rebuild_hint(to)})")


def file_crc(path: Path) -> int:
    """The CRC-32 of a whole file, read a chunk at a time."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_sums(folder: Path, names: list[str]) -> dict[str, int]:
    """The CRC-32 of each named file of `folder` that is there (a conversion's manifest `files`)."""
    return {name: file_crc(folder / name) for name in names if (folder / name).is_file()}


def check_files(folder: Path, recorded: dict[str, int], names: list[str], to: str) -> None:
    """Each of `names` (of the `recorded` CRC-32s of the conversion `to` in `folder`) read whole and compared;
    a file missing or damaged raises `DamagedConversion` naming it."""
    for name in sorted(names):
        path = folder / name
        try:
            crc = file_crc(path)
        except FileNotFoundError:
            raise DamagedConversion(f"{path}: not found (the conversion's manifest lists it); {rebuild_hint(to)}") \
                from None
        if crc != recorded[name]:
            raise damaged(str(path), to)


# ---------------------------------------------------------------------------------------------
# The source's content


def source_digest(dataset, threads: int = 8) -> str:
    """A digest of every sample's stored bytes (CRC-32 each, in sample order): what `--verify` compares
    with the digest a conversion recorded, to find a file replaced by other bytes of the same size."""
    return digest_of(sample_crcs(dataset, 0, len(dataset), threads))


def sample_crcs(dataset, start: int, stop: int, threads: int = 8) -> np.ndarray:
    """The CRC-32 of samples start..stop-1's stored bytes: `source_digest`'s part for those samples, so that
    machines can each read a part (the `ray` engine) into the same digest."""
    def one(index: int) -> int:
        return zlib.crc32(dataset.read(index))

    with ThreadPoolExecutor(threads) as pool:  # zlib and file reads release the GIL
        return np.fromiter(pool.map(one, range(start, stop)), np.uint32, stop - start)


def digest_of(crcs: np.ndarray) -> str:
    """`source_digest` of every sample's CRC-32, in sample order."""
    digest = hashlib.sha256()
    for index, crc in enumerate(crcs.tolist()):
        digest.update(f"{index}:{crc:08x}\n".encode())
    return digest.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Temporary files of conversions


def temp_path(final: Path) -> Path:
    """A temporary name beside `final` that says which process writes it (host and pid), so that
    the next conversion can tell a killed writer's leftover from a live one's work."""
    token = os.urandom(4).hex()
    return final.with_name(f".{final.name}.{socket.gethostname()}.{os.getpid()}.{token}.tmp")


def remove_dead_temps(folder: Path, stale_seconds: float = 24 * 3600) -> list[Path]:
    """Remove `.*.tmp` files and folders in `folder` whose writer is gone: a process of this host
    that no longer exists, or (another host's, or an older name without a pid) not touched for
    `stale_seconds`. Best effort; returns what was removed."""
    import time

    removed: list[Path] = []
    host = socket.gethostname()
    try:
        entries = list(folder.glob(".*.tmp"))
    except OSError:
        return removed
    for entry in entries:
        prefix, _, pid = entry.name[:-len(".tmp")].rpartition(".")[0].rpartition(".")
        try:
            alive = True
            if prefix.endswith("." + host) and pid.isdigit():
                alive = _pid_alive(int(pid))
            elif time.time() - entry.stat().st_mtime > stale_seconds:
                alive = False
            if not alive:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry)
        except OSError:
            continue
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


# ---------------------------------------------------------------------------------------------
# Permissions and space


def no_space_error(folder: Path, needed_bytes: int, what: str, bound: bool = False) -> DatasetError:
    """`folder: no space left ...` naming what needed the space, how much (`bound`: at most that), and how
    much is free."""
    try:
        free = f"{_size(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "free space unknown"
    amount = f"{'up to' if bound else 'about'} {_size(needed_bytes)}"
    return DatasetError(f"{folder}: no space left on device: {what} needs {amount} "
                        f"({free}); nothing was kept. Free some space or set LOADOPT_CACHE to a larger disk")


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 1e3:,.1f} kB"


def iter_file_chunks(path: Path, chunks: list[int]) -> Iterator[tuple[int, bytes]]:
    """(chunk number, bytes) of the given `CHUNK_BYTES` chunks of a file."""
    with open(path, "rb") as handle:
        for k in chunks:
            handle.seek(k * CHUNK_BYTES)
            yield k, handle.read(CHUNK_BYTES)


# ---------------------------------------------------------------------------------------------
# Samples a conversion cannot decode


def guarded(decode: Callable[[int], object], index: int) -> tuple[object | None, str]:
    """`decode(index)`, or (None, what was wrong with the sample): a conversion pool worker's answer
    (`functools.partial(guarded, decode)` pickles by reference)."""
    from loadopt.errors import describe_sample_error

    try:
        return decode(index), ""
    except Exception as exc:  # noqa: BLE001 - a bad sample is the caller's to report, by policy
        return None, describe_sample_error(exc)


def keep_or_skip(dataset, ids, results, on_error: str, skipped: list, blank: Callable[[], object]) -> list:
    """The decoded value of each sample of `ids` (`results`: `guarded`'s answers). A sample that failed
    raises naming its file (`on_error: raise`), or becomes `blank()`, recorded in `skipped` as
    `[index, reason]` (`skip`): the conversion keeps its row, every loader reports it as unreadable."""
    out = []
    for index, (value, reason) in zip(ids, results, strict=True):
        if value is None:
            if on_error != "skip":
                raise DatasetError(f"{shown_name(dataset.path(int(index)))}: {reason} (set dataset.on_error: skip to "
                                   "convert without it)")
            skipped.append([int(index), reason])
            value = blank()
        out.append(value)
    return out
