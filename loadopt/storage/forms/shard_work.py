"""Writing a conversion as shards, resumable: what the raw and Arrow forms' conversions
share.

The shards are planned before any is written (`plan_shards`: whole source shards grouped up to `shard_mib` by
the samples' estimated stored sizes), so each can be written on its own, by this process or by a task on
another machine, and the same plan gives the same shards whichever wrote them.
They are written into a work folder beside the conversion's (`.<name>.partial`), each one finished on its
own: its files under temporary names, read back against the checksums taken while it was written, renamed, and
then its entry `shard-0000k.json` written by rename, the mark that it is done. A conversion that was stopped
(Ctrl-C, a kill, a full disk, a lost machine) and run again keeps every finished shard of the same plan and
writes the others (a full disk instead removes them: the space goes back). The manifest is written once every
shard is there and the whole folder checked; the work folder is then renamed into place, so a reader never sees
a conversion without its manifest. One conversion runs at a time (a lock in the work folder); another waits for
it and finds the conversion done."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from loadopt.errors import DatasetError
from loadopt.files import is_no_space
from loadopt.storage.forms import integrity
from loadopt.storage.sources.shards import shard_table, source_shard_keys

DEFAULT_SHARD_MIB = 256.0  # storage.shard_mib: a shard file's size, about
MANIFEST = "manifest.json"  # written last: the conversion is finished exactly when it is there
RUN = "run.json"  # the key, source digest and plan the work folder's shards were written for
PLAN_VERSION = 2  # 2: shards planned up front, whole source shards (1: cut while writing); in RUN, not the key
LOCK = "lock"


def shard_stem(k: int) -> str:
    return f"shard-{k:05d}"


def entry_name(k: int) -> str:
    """Shard k's entry: the mark that it is finished, and its row of the manifest's shard table."""
    return f"{shard_stem(k)}.json"


def work_folder(final: Path) -> Path:
    """Where the shards of `final` are written until every one is there (kept across runs: the resume)."""
    return final.with_name(f".{final.name}.partial")


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        np.save(handle, array, allow_pickle=False)
    os.replace(tmp, path)


def source_span(bounds: np.ndarray, first: int, samples: int) -> list[int]:
    """The first and last source shard (the `ShardTable`'s `bounds`) of samples first..first+samples-1."""
    last = first + max(samples, 1) - 1
    span = np.searchsorted(bounds, [first, last], side="right") - 1
    return [int(span[0]), int(span[1])]


def read_manifest(root: Path, what: str) -> dict[str, Any]:
    """The conversion's manifest; one line naming the folder when it is missing or unreadable."""
    path = root / MANIFEST
    if not path.exists():
        raise DatasetError(f"{root}: {what} not found (no {MANIFEST})")
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("shard_table"), list):
            raise ValueError("no shard table")
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: corrupt manifest ({str(exc).splitlines()[0]})") from None
    return meta


def finished_shards(work: Path, jobs: list[ShardJob], intact: Callable[[int, Any], bool]) -> dict[int, Any]:
    """The entries of the planned shards already finished in `work` (whatever order they were written in): each
    one's entry holds the samples `jobs` plans for it and `intact(k, entry)` finds its files whole."""
    done: dict[int, Any] = {}
    for job in jobs:
        try:
            entry = json.loads((work / entry_name(job.k)).read_text())
            if entry.get("first") == job.start and entry.get("samples") == job.stop - job.start and \
                    intact(job.k, entry):
                done[job.k] = entry
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return done


def build(final: Path, run: dict, what: str, needed: int, bound: bool, rebuild: bool,
          write: Callable[[Path], list[Any]], manifest: Callable[[list[Any]], Mapping[str, Any]],
          check: Callable[[Path], object]) -> Path:
    """Write the conversion `final` shard by shard in its work folder, resuming the shards finished there for the
    same `run` (its key, source digest and plan): `write(work)` writes the shards not finished there and returns
    every entry; `manifest(entries)` is written last, then `check(work)` opens the whole folder before it is
    renamed into place. `rebuild` replaces a finished conversion (forced, or its source changed); `what`,
    `needed` and `bound` word the message when the disk is full."""
    work = work_folder(final)
    try:
        lock = hold_lock(work)
    except OSError as exc:
        if is_no_space(exc):
            raise integrity.no_space_error(final.parent, needed, what, bound) from None
        raise DatasetError(f"{final.parent}: cannot write {what} ({exc.strerror or exc}); "
                           "set storage.converted to a writable folder") from None
    if lock is None:  # another process finished it while this one waited
        return final
    try:
        if (final / MANIFEST).exists() and not rebuild:
            return final
        start_or_resume(work, {**run, "plan": PLAN_VERSION}, fresh=rebuild)
        entries = write(work)
        for leftover in work.glob(".*.tmp"):  # of a task killed mid-shard (its retry wrote the shard again)
            leftover.unlink(missing_ok=True)
        write_text(work / MANIFEST, json.dumps(manifest(entries)))
        check(work)
        (work / RUN).unlink()
        if final.exists():  # forced, or a damaged one: the old conversion goes only once the new one is complete
            old = final.with_name(f".{final.name}.{os.getpid()}.old.tmp")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        (work / LOCK).unlink()
        os.replace(work, final)
    except OSError as exc:
        if is_no_space(exc):  # the finished shards would keep the disk full: the space goes back to the user
            shutil.rmtree(work, ignore_errors=True)
            raise integrity.no_space_error(final.parent, needed, what, bound) from None
        raise
    finally:
        lock.close()
    return final


def hold_lock(work: Path) -> IO[str] | None:
    """The work folder's lock, held (blocking while another process converts); None when that process finished
    the conversion meanwhile (its work folder became the conversion)."""
    while True:
        work.mkdir(parents=True, exist_ok=True)
        lock = open(work / LOCK, "a")  # noqa: SIM115 - the caller closes it
        # A POSIX record lock, not flock: the decode pool's forked workers (which may outlive a conversion
        # stopped by an error for a while) would share a flock and hold it; a record lock is this process's.
        fcntl.lockf(lock, fcntl.LOCK_EX)
        try:
            if os.stat(work / LOCK).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock  # the folder's own lock: nobody renamed it away while this one waited
        except FileNotFoundError:
            pass
        lock.close()
        if (work.with_name(work.name[1 : -len(".partial")]) / MANIFEST).exists():
            return None


def start_or_resume(work: Path, run: dict, fresh: bool = False) -> None:
    """Keep the work folder's finished shards when they were written for this same conversion (and not
    `fresh`); else start it afresh. Temporary files of a writer that died are removed (this process holds the
    lock)."""
    for leftover in work.glob(".*.tmp"):
        leftover.unlink(missing_ok=True)
    try:
        same = not fresh and json.loads((work / RUN).read_text()) == run
    except (OSError, ValueError):
        same = False
    if not same:
        for entry in work.iterdir():
            if entry.name != LOCK:
                entry.unlink()
        write_text(work / RUN, json.dumps(run))


# ---------------------------------------------------------------------------------------------
# A changed source: only the shards of the source shards that changed are converted again


@dataclass(frozen=True)
class Segment:
    """Samples start..stop-1 of the conversion being written: converted from the source, or (`reused`) the
    shard `reused` of the earlier conversion in `root` whose samples these are, unchanged in the source."""

    start: int
    stop: int
    reused: Mapping[str, Any] | None = None
    root: Path | None = None


def source_table(dataset: Any) -> list[list] | None:
    """[key, first sample, samples] of each source shard, kept in the manifest so that the next
    conversion of a changed source knows which shards it can keep; None where the source has no keyed shards."""
    keys = source_shard_keys(dataset)
    if keys is None:
        return None
    bounds = shard_table(dataset).bounds.tolist()
    return [[key, bounds[s], bounds[s + 1] - bounds[s]] for s, key in enumerate(keys)]


def lineage(key: Mapping[str, Any], dataset: Any) -> str:
    """What a conversion is of, but for the source's content: the same for the conversions of one dataset (its root)
    in one form and settings, before and after a source shard changed."""
    settings = {k: v for k, v in key.items() if k not in ("source", "rows")}
    text = json.dumps({"root": str(dataset.root), "kind": type(dataset).__name__, **settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def predecessor(final: Path, line: str) -> tuple[Path, dict] | None:
    """The newest finished conversion beside `final` of the same lineage that kept its source table."""
    found: list[tuple[float, Path, dict]] = []
    for folder in final.parent.iterdir() if final.parent.is_dir() else []:
        if folder == final or folder.name.startswith(".") or not (folder / MANIFEST).is_file():
            continue
        try:
            meta = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("lineage") == line and meta.get("source_table"):
            found.append(((folder / MANIFEST).stat().st_mtime, folder, meta))
    return max(found, key=lambda f: f[0])[1:] if found else None


def plan(samples: int, table: list[list] | None, earlier: tuple[Path, dict] | None) -> list[Segment]:
    """The segments of a conversion of `samples` samples whose source shards are `table`: each shard of the `earlier`
    conversion whose source shards are all unchanged (same key, same samples) and still consecutive is reused at
    its samples' new place; the samples between them are converted."""
    if not table or earlier is None:
        return [Segment(0, samples)]
    root, meta = earlier
    now = {key: (first, count) for key, first, count in table}
    before = meta["source_table"]
    reused: list[Segment] = []
    for entry in meta["shard_table"]:
        a, b = entry["source_shards"]
        pieces = before[a : b + 1]
        places = [now.get(key) for key, _, _ in pieces]
        if any(p is None or p[1] != count for p, (_, _, count) in zip(places, pieces, strict=True)):
            continue
        if any(p[0] + p[1] != q[0] for p, q in zip(places, places[1:], strict=False)):  # type: ignore[index]
            continue
        start = places[0][0] + entry["first"] - pieces[0][1]  # type: ignore[index]
        reused.append(Segment(start, start + entry["samples"], entry, root))
    segments, at = [], 0
    for segment in sorted(reused, key=lambda s: s.start):
        if segment.start < at:
            continue
        if segment.start > at:
            segments.append(Segment(at, segment.start))
        segments.append(segment)
        at = segment.stop
    if at < samples:
        segments.append(Segment(at, samples))
    return segments


@dataclass(frozen=True)
class ShardJob:
    """Shard k of a conversion: samples start..stop-1, converted from the source or (`reused`) linked from an
    earlier conversion's shard of unchanged source shards."""

    k: int
    start: int
    stop: int
    reused: Segment | None = None


def plan_shards(segments: list[Segment], stored: np.ndarray, source_bounds: np.ndarray, limit: int) -> list[ShardJob]:
    """The shards of a conversion: each reused segment one shard; the samples to convert cut into shards of whole
    source shards (`source_bounds`) holding at most `limit` bytes by `stored`, each sample's
    estimated stored size (a source shard larger than that is cut between samples; a sample larger than `limit`
    is a shard of its own). Decided before anything is written, so any process can write any shard."""
    sums = np.concatenate([[0], np.cumsum(stored, dtype=np.int64)])
    jobs: list[ShardJob] = []
    for segment in segments:
        if segment.reused is not None:
            jobs.append(ShardJob(len(jobs), segment.start, segment.stop, segment))
            continue
        inside = source_bounds[(source_bounds > segment.start) & (source_bounds < segment.stop)]
        cuts = np.concatenate([inside, [segment.stop]]).astype(np.int64)
        at = segment.start
        while at < segment.stop:
            fits = int(np.searchsorted(sums[cuts], sums[at] + limit, side="right"))  # whole source shards that fit
            if fits:
                stop = int(cuts[fits - 1])
            else:  # the next source shard alone is too large: as many of its samples as fit, at least one
                stop = max(at + 1, int(np.searchsorted(sums, sums[at] + limit, side="right")) - 1)
                stop = min(stop, int(cuts[0]))
            jobs.append(ShardJob(len(jobs), at, stop))
            at = stop
            cuts = cuts[cuts > at]
    return jobs


def link(source: Path, target: Path) -> None:
    """`target` as a hard link to `source` (no copy), or a copy where they are on different filesystems."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)


def reused_skips(segment: Segment) -> list:
    """The reused shard's skipped samples, at their new indices."""
    assert segment.reused is not None
    shift = segment.start - segment.reused["first"]
    return [[int(i) + shift, why] for i, why in segment.reused["skipped"]]
