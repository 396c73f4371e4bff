"""Writing a raw conversion in the raw form's layout shard by shard, resumable (the shard work all conversions
share: the work folder, the planned shards, the resume, the manifest written last, one conversion at a time): each
shard's .bin, index (and frames) are written under temporary names, the .bin read back against the checksums
taken while it was written, then renamed, its entry last.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np

from loadopt.errors import DatasetError
from loadopt.storage.forms import arrow_format, decode_pool, integrity, shard_work
from loadopt.storage.forms.arrow_format import Form
from loadopt.storage.forms.engine import LOCAL, ConvertEngine, WriteShard
from loadopt.storage.forms.engines import running, source_digest, write_shards
from loadopt.storage.forms.raw_format import (
    INDEX_DTYPE,
    MANIFEST,
    RawIndex,
    RawMeta,
    ShardEntry,
    align_up,
    conversion_key,
    open_raw,
    raw_path,
    shard_bytes,
    shard_frames_name,
    shard_index_name,
    shard_name,
)
from loadopt.storage.remote import converted as remote_shards
from loadopt.storage.sources.shards import shard_table

log = logging.getLogger(__name__)

def samples(dataset, form: Form, size: int | None, workers: int, dims: list, on_error: str = "raise",
            skipped: list | None = None, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
    """Each sample's bytes in order from sample `start` to `stop` (the end); one that cannot be decoded goes by
    `on_error` (`skip`: a blank one, `[index, reason]` appended to `skipped`)."""
    n = len(dataset)
    skipped = [] if skipped is None else skipped
    ids = range(start, n if stop is None else stop)
    if form == "tokens":
        windows = dataset.windows()
        for i in ids:
            yield windows[i].tobytes()
        return
    if form == "records":
        for i in ids:
            yield dataset.read(i)
        return
    if form == "reencoded" and not size:
        raise ValueError("the reencoded form is bounded by a max side: none was given")
    # The Arrow forms' own functions: the same bytes in both forms (bit-equal pixels for the decoded ones).
    work, chunk, blank = {  # blank: what a sample that goes by on_error (skip) is stored as
        "frames": (arrow_format.decode_frame, 16, lambda: (bytes(3), (1, 1, 1, 1))),
        "encoded": (arrow_format.encode_sample, 16, lambda: b""),  # bytes that are no image: by on_error
        "reencoded": (arrow_format.reencode_sample, 4, lambda: b""),
        "decoded": (arrow_format.decode_centre, 16, lambda: bytes((size or 0) ** 2 * 3)),
    }[form]
    arrow_format.set_pool_dataset(dataset, size)
    pool = decode_pool.start(workers)
    try:
        guarded = partial(integrity.guarded, work)
        for i, result in zip(ids, pool.imap(guarded, ids, chunksize=chunk) if pool else map(guarded, ids),
                             strict=True):
            kept = integrity.keep_or_skip(dataset, [i], [result], on_error, skipped, blank)[0]
            if form == "frames":
                blob, frame = kept
                dims.append(frame)
                yield blob
            else:
                yield kept
    finally:
        decode_pool.stop(pool)


def _intact(work: Path, remote_sizes: dict[str, int] | None, k: int, entry: dict) -> bool:
    size = remote_sizes.get(shard_name(k)) if remote_sizes is not None else (work / shard_name(k)).stat().st_size
    return size == entry["bytes"] and (work / shard_index_name(k)).exists()


def reference_names(meta: dict) -> list[str]:
    """A raw conversion's files besides its shard data and manifest: each shard's index (and frame dims)."""
    shards = range(len(meta["shard_table"]))
    return [shard_index_name(k) for k in shards] + \
        ([shard_frames_name(k) for k in shards] if meta.get("form") == "frames" else [])


def data_home(dataset, final: Path) -> remote_shards.RemoteShards | None:
    """Where the shard data of the finished conversion `final` is when `final` holds its reference only."""
    return remote_shards.data_home(dataset, final, "raw shards", shard_name)


def open_conversion(dataset, form: Form, size: int | None, shard_mib: float, **checks) -> RawIndex:
    """The finished raw conversion of `dataset` opened (`open_raw`, `checks` its options), its reference fetched
    from the conversions' remote home first when this machine has none."""
    final = raw_path(dataset, form, size, shard_mib)
    remote_shards.fetch_reference(dataset, final, reference_names)
    data = data_home(dataset, final)
    if data is not None and remote_shards.moved_away(data):
        raise DatasetError(f"{final}: the reference of a raw conversion whose shards are not at {data.where()} "
                           "(storage.converted changed since); convert it there with `loadopt convert CONFIG --to "
                           "raw ...`")
    return open_raw(final, dataset, form, size, shard_mib, data=data, **checks)


class _ShardWriter:
    """One shard being written: its .bin under a temporary name, its rows, checksums and skipped samples."""

    def __init__(self, work: Path, k: int, first: int) -> None:
        self.work, self.k, self.first = work, k, first
        self.tmp = work / f".{shard_name(k)}.{os.getpid()}.tmp"
        self.out = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish()/abandon()
        self.sums = integrity.ChunkSums()
        self.rows: list[tuple[int, int]] = []  # (offset, length)
        self.frames: list = []
        self.position = 0

    def add(self, blob: bytes) -> None:
        padded = int(align_up(len(blob)))
        for piece in (blob, bytes(padded - len(blob))):
            self.out.write(piece)
            self.sums.update(piece)
        self.rows.append((self.position, len(blob)))
        self.position += padded

    def finish(self, labels: np.ndarray, skipped: list, table_bounds: np.ndarray, form: Form) -> ShardEntry:
        """Close, verify and rename the shard's files; its entry written last (the mark that it is done)."""
        self.out.close()
        checksums = self.sums.finish()
        for c, data in integrity.iter_file_chunks(self.tmp, list(range(len(checksums)))):
            if zlib.crc32(data) != checksums[c]:
                raise DatasetError(f"{self.tmp}: chunk {c} reads back other bytes than were written (a failing "
                                   "disk or a concurrent writer)")
        n = len(self.rows)
        index = np.zeros(n, INDEX_DTYPE)
        index["sample_id"] = np.arange(self.first, self.first + n)
        index["shard"] = self.k
        if n:
            index["offset"], index["length"] = np.array(self.rows, dtype=np.int64).T
        index["label"] = labels[self.first : self.first + n]
        shard_work.write_npy(self.work / shard_index_name(self.k), index)
        if form == "frames":
            shard_work.write_npy(self.work / shard_frames_name(self.k), np.array(self.frames, np.int32).reshape(n, 4))
        os.replace(self.tmp, self.work / shard_name(self.k))
        entry = ShardEntry(shard=self.k, first=self.first, samples=n, bytes=self.position, checksums=checksums,
                           skipped=[s for s in skipped if self.first <= int(s[0]) < self.first + n],
                           source_shards=shard_work.source_span(table_bounds, self.first, n),
                           max_length=max((length for _, length in self.rows), default=0))
        shard_work.write_text(self.work / shard_work.entry_name(self.k), json.dumps(entry))
        return entry

    def abandon(self) -> None:
        self.out.close()
        self.tmp.unlink(missing_ok=True)


def _labels(dataset, form: Form) -> np.ndarray:
    return np.zeros(len(dataset), np.int64) if form == "tokens" else np.asarray(dataset.labels)


def _write_shard(work: Path, job: shard_work.ShardJob, workers: int, written: Callable[[int], None] | None,
                 dataset, form: Form, size: int | None, on_error: str) -> ShardEntry:
    """Convert the samples of shard `job` into it (`workers` decode processes); its entry returned."""
    skipped: list[list[int | str]] = []
    writer = _ShardWriter(work, job.k, job.start)
    try:
        dims: list = []
        for i, blob in enumerate(samples(dataset, form, size, workers, dims, on_error, skipped, job.start, job.stop)):
            writer.add(blob)
            if form == "frames":
                writer.frames.append(dims[-1])
            if written is not None and ((i + 1) % 256 == 0 or job.start + i + 1 == job.stop):
                written(i + 1)
        return writer.finish(_labels(dataset, form), skipped, shard_table(dataset).bounds, form)
    except BaseException:
        writer.abandon()
        raise


def _reuse(work: Path, job: shard_work.ShardJob, dataset, form: Form,
           remote: remote_shards.RemoteShards | None) -> ShardEntry:
    """Shard k: an earlier conversion's shard of source shards that did not change, linked (not copied; on a remote
    home, copied there), its index rewritten with the samples' new numbers and labels."""
    k, segment = job.k, job.reused
    assert segment is not None and segment.reused is not None and segment.root is not None
    old, j = segment.root, int(segment.reused["shard"])
    if remote is None:
        shard_work.link(old / shard_name(j), work / shard_name(k))
    elif (old / shard_name(j)).exists():  # an earlier conversion kept whole on this disk
        remote.upload(old / shard_name(j), shard_name(k))
    else:
        earlier = remote_shards.destination(dataset, old)
        assert earlier is not None, "a conversion for a remote home follows one for the same home"
        remote.copy(earlier, shard_name(j), shard_name(k))
    if form == "frames":
        shard_work.link(old / shard_frames_name(j), work / shard_frames_name(k))
    index = np.load(old / shard_index_name(j), allow_pickle=False)
    index["sample_id"] = np.arange(segment.start, segment.stop)
    index["shard"] = k
    index["label"] = _labels(dataset, form)[segment.start : segment.stop]
    shard_work.write_npy(work / shard_index_name(k), index)
    entry = ShardEntry(**{**segment.reused, "shard": k, "first": segment.start,  # type: ignore[typeddict-item]
                          "skipped": shard_work.reused_skips(segment), "kept_from": old.name,
                          "source_shards": shard_work.source_span(shard_table(dataset).bounds, segment.start,
                                                                  segment.stop - segment.start)})
    shard_work.write_text(work / shard_work.entry_name(k), json.dumps(entry))
    return entry


def _manifest(dataset, form: Form, size: int | None, shard_mib: float, digest: str, entries: list[ShardEntry],
              source_table: list[list] | None, work: Path) -> RawMeta:
    """The manifest of the conversion whose shards `entries` are in `work`, with the CRC-32 of each of their index
    (and frame dims) files: the build's check then reads every index row against the source."""
    key = conversion_key(dataset, form, size, shard_mib)
    meta = RawMeta(**key, source_content=digest, skipped=[s for e in entries for s in e["skipped"]],
                   checksums={"algorithm": integrity.ALGORITHM, "chunk_bytes": integrity.CHUNK_BYTES},
                   shard_table=entries, lineage=shard_work.lineage(key, dataset), source_table=source_table)
    meta["files"] = integrity.file_sums(work, reference_names(dict(meta)))
    return meta


def convert(dataset, form: Form, size: int | None = None, shard_mib: float = 256.0,
            progress: Callable[[int, int], None] | None = None, workers: int | None = None, *,
            on_error: str = "raise", force: bool = False, verify: bool = False,
            engine: ConvertEngine = LOCAL) -> Path:
    """Convert `dataset` to raw shards (or reuse the finished conversion); returns the folder. A conversion
    stopped part way resumes from its finished shards. `on_error`, `force`, `verify` and `engine` as for
    `arrow_convert.convert`."""
    final = raw_path(dataset, form, size, shard_mib)
    integrity.remove_dead_temps(final.parent)  # what a killed conversion left, whatever this one does
    remote_shards.fetch_reference(dataset, final, reference_names)  # made on another machine for the same home
    done = (final / MANIFEST).exists()
    force = force or (done and remote_shards.converted_elsewhere_since(final, data_home(dataset, final)))
    if done and not force and not verify:
        return final
    with running(engine):  # Ray joined or started for the digest and the shards, stopped after
        # The source's content, recorded with the conversion: read once more, so only where that is cheap
        # (a local disk) or asked for (--verify).
        # (records: their fingerprint has each file's name, size and mtime; a sample is not a stored blob)
        cores = workers or os.cpu_count() or 1
        digest = source_digest(dataset, engine, cores) if form not in ("tokens", "records") and \
            (verify or dataset.is_local()) else ""
        if (final / MANIFEST).exists() and not force:
            try:  # every chunk, index and frame dims file, and every index row read against the source
                if open_raw(final, dataset, form, size, shard_mib, verify_labels=True, verify="all",
                            data=data_home(dataset, final)).meta.get("source_content") == digest:
                    return final
                log.warning("%s: the source's content differs from the converted one's: converting again", final)
            except integrity.DamagedConversion as exc:
                log.warning("%s: converting again", exc.finding())
                force = True  # nothing taken from the earlier conversions: a shard of theirs may be linked here
        needed = int(arrow_format.needed_bytes(dataset, form, size) * 1.05)  # + the 4 KiB alignment, about
        key = conversion_key(dataset, form, size, shard_mib)
        table = shard_work.source_table(dataset)
        earlier = shard_work.predecessor(final, shard_work.lineage(key, dataset)) if table and not force else None
        stored = align_up(arrow_format.stored_sizes(dataset, form, size)).astype(np.int64)
        segments = shard_work.plan(len(dataset), table, earlier)
        jobs = shard_work.plan_shards(segments, stored, shard_table(dataset).bounds, shard_bytes(shard_mib))
        write: WriteShard = partial(_write_shard, dataset=dataset, form=form, size=size, on_error=on_error)
        remote = remote_shards.writable_destination(dataset, final)
        if remote is not None:  # each shard's data uploaded by its writer; its reference kept here
            write = partial(remote_shards.write_and_upload, write, remote, shard_name)
            remote.unfinish()
        reuse = partial(_reuse, dataset=dataset, form=form, remote=remote)
        built = shard_work.build(
            final, {"key": key, "source_content": digest, "earlier": earlier[0].name if earlier else None},
            f"the raw conversion ({form})", needed, form == "frames", force or verify,
            write=lambda work: write_shards(
                work, jobs, partial(_intact, work, remote.sizes() if remote else None), write, reuse, engine,
                workers or os.cpu_count() or 1, progress, receive=remote_shards.receive if remote else None),
            manifest=lambda entries: _manifest(dataset, form, size, shard_mib, digest, entries, table,
                                               shard_work.work_folder(final)),
            check=lambda work: open_raw(work, dataset, form, size, shard_mib, verify_labels=True, verify="none",
                                        data=remote))
        if remote is not None:
            remote_shards.publish(dataset, built, remote)  # the reference beside the data, its manifest last
        return built
