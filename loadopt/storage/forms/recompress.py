"""`loadopt recompress`: a folder of WebDataset tar shards rewritten with every JPEG member losslessly recompressed
as JPEG XL, about a fifth fewer bytes to store and to move from remote storage.

Each shard keeps its members, their order and their keys; a `<key>.jpg` (or `.jpeg`) member becomes `<key>.jxl`
where libjxl gives back its exact bytes, and stays as it was otherwise (a PNG named .jpg, a damaged JPEG, one
that would not shrink). loadopt's sources read a `.jxl` member as the JPEG it was made from (every pixel and
checksum the same); other readers see a standard JPEG XL image.

Every shard is written beside its final name and renamed into place once whole: a stopped run leaves no
half-written shard, and the same command goes on with the shards not yet written (a destination shard older
than its source is written again).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loadopt.errors import ConfigError, DatasetError
from loadopt.imaging import jxl

JPEG_SUFFIXES = (".jpg", ".jpeg")


@dataclass(frozen=True)
class ShardRecompressed:
    """One shard's outcome: its bytes before and after, JPEG members recompressed and kept as they were."""

    name: str
    bytes_before: int
    bytes_after: int
    recompressed: int
    kept: int
    reused: bool = False


@dataclass(frozen=True)
class Recompressed:
    """A whole run's outcome (`loadopt recompress`)."""

    shards: list[ShardRecompressed]

    @property
    def bytes_before(self) -> int:
        return sum(s.bytes_before for s in self.shards)

    @property
    def bytes_after(self) -> int:
        return sum(s.bytes_after for s in self.shards)

    @property
    def recompressed(self) -> int:
        return sum(s.recompressed for s in self.shards)

    @property
    def kept(self) -> int:
        return sum(s.kept for s in self.shards)


def source_shards(source: Path) -> list[Path]:
    """The `.tar` shards directly in `source`, sorted; one line where there are none."""
    if not source.is_dir():
        raise ConfigError(f"{source}: not a folder of tar shards")
    shards = sorted(p for p in source.iterdir() if p.suffix == ".tar" and p.is_file())
    if not shards:
        raise ConfigError(f"{source}: no .tar shards in it")
    return shards


def recompress_shard(source: Path, destination: Path) -> ShardRecompressed:
    """`source` (a tar shard) written to `destination` with its JPEG members as JPEG XL where that is exact."""
    recompressed = kept = 0
    partial = destination.with_name(f"{destination.name}.tmp-{os.getpid()}")
    try:
        with tarfile.open(source, "r:") as reader, tarfile.open(partial, "w:", format=tarfile.GNU_FORMAT) as writer:
            for member in reader:
                data = reader.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
                stem, suffix = os.path.splitext(member.name)
                if data is not None and suffix.lower() in JPEG_SUFFIXES:
                    packed = jxl.recompress_jpeg(data)
                    if packed is None:
                        kept += 1
                    else:
                        recompressed += 1
                        member = _renamed(member, stem + ".jxl", len(packed))
                        data = packed
                writer.addfile(member, io.BytesIO(data) if data is not None else None)
        os.replace(partial, destination)
    except (tarfile.TarError, EOFError) as exc:
        raise DatasetError(f"{source}: not a readable tar shard ({exc})") from None
    finally:
        partial.unlink(missing_ok=True)
    return ShardRecompressed(source.name, source.stat().st_size, destination.stat().st_size, recompressed, kept)


def _renamed(member: tarfile.TarInfo, name: str, size: int) -> tarfile.TarInfo:
    renamed = tarfile.TarInfo(name)
    renamed.size, renamed.mtime, renamed.mode = size, member.mtime, member.mode
    renamed.uid, renamed.gid, renamed.uname, renamed.gname = member.uid, member.gid, member.uname, member.gname
    return renamed


def _is_done(source: Path, destination: Path) -> bool:
    return destination.exists() and destination.stat().st_mtime >= source.stat().st_mtime


def recompress_shards(source: Path, destination: Path, workers: int | None = None, force: bool = False,
                      progress: Callable[[int, int], None] | None = None) -> Recompressed:
    """Every shard of `source` recompressed into `destination` (created), `workers` processes at once (default:
    this machine's cores); shards written before and newer than their source kept unless `force`."""
    jxl.codec()  # no imagecodecs: the one line that says how to get it, before any work
    shards = source_shards(source)
    if destination.resolve() == source.resolve():
        raise ConfigError(f"{destination}: the destination must not be the source folder")
    try:
        destination.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{destination}: cannot be created ({exc.strerror})") from None
    results: list[ShardRecompressed] = []
    todo = []
    for shard in shards:
        target = destination / shard.name
        if not force and _is_done(shard, target):
            results.append(ShardRecompressed(shard.name, shard.stat().st_size, target.stat().st_size, 0, 0, True))
        else:
            todo.append((shard, target))
    if progress:
        progress(len(results), len(shards))
    pool = ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1)
    try:
        for done in pool.map(recompress_shard, *zip(*todo, strict=True)) if todo else ():
            results.append(done)
            if progress:
                progress(len(results), len(shards))
    except BaseException:  # an error or a stop: the shards under way land whole (or not at all), no other starts
        pool.shutdown(cancel_futures=True)
        raise
    pool.shutdown()
    return Recompressed(sorted(results, key=lambda r: r.name))
