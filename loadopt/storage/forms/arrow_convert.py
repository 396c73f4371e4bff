"""Writing the Arrow form in its layout shard by shard, resumable (the shard work all conversions share: the
work folder, the planned shards, the resume, the manifest written last, one conversion at a time): each shard is
an Arrow IPC file of whole record batches (from the shard's first sample, `rows_per_batch` each), read back
against its batches' checksums, renamed, its entry last. Where the conversions' home is remote storage, each
shard's writer uploads it there and the conversion's folder keeps its outline.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa

from loadopt.errors import DatasetError
from loadopt.imaging.frames import FRAME_FIELDS
from loadopt.storage.forms import decode_pool, integrity, shard_work, tier_reads
from loadopt.storage.forms.arrow_format import (
    DEFAULT_SHARD_MIB,
    ArrowConversion,
    Form,
    arrow_path,
    arrow_schema,
    batch_metadata,
    conversion_key,
    decode_centre,
    decode_frame,
    encode_sample,
    needed_bytes,
    open_arrow,
    read_shard,
    reencode_sample,
    rows_per_batch,
    set_pool_dataset,
    shard_bytes,
    shard_name,
    square_bytes,
    stored_sizes,
)
from loadopt.storage.forms.arrow_outline import Outline, outline_name
from loadopt.storage.forms.engine import LOCAL, ConvertEngine, WriteShard
from loadopt.storage.forms.engines import running, source_digest, write_shards
from loadopt.storage.remote import converted as remote_shards
from loadopt.storage.sources.shards import shard_table

log = logging.getLogger(__name__)


def record_batches(dataset, schema: pa.Schema, form: Form, size: int | None, progress, workers: int,
                   on_error: str = "raise", skipped: list | None = None, first: int = 0, stop: int | None = None):
    """The record batches of the conversion from sample `first` to `stop` (the end); samples that cannot be decoded
    go by `on_error` (`skip`: a zero row, its `[index, reason]` appended to `skipped`)."""
    n = len(dataset)
    end = n if stop is None else stop
    skipped = [] if skipped is None else skipped
    pool = None
    square = square_bytes(size) if form == "decoded" else 0  # bytes of a decoded row
    if form == "reencoded" and not size:
        raise ValueError("the reencoded form is bounded by a max side: none was given")
    if form in ("decoded", "frames", "reencoded", "encoded"):
        set_pool_dataset(dataset, size)
        pool = decode_pool.start(workers)
    step = rows_per_batch(dataset, form)
    try:
        for start in range(first, end, step):
            ids = np.arange(start, min(end, start + step), dtype=np.int64)
            if form == "records":
                column = pa.array([dataset.read(int(i)) for i in ids], type=pa.large_binary())
                yield pa.record_batch([pa.array(ids), pa.array(dataset.labels[ids]), column], schema=schema)
            elif form == "tokens":
                windows = np.ascontiguousarray(dataset.windows()[ids])
                column = pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(windows.shape[1] * windows.itemsize), len(ids), [None, pa.py_buffer(windows)])
                yield pa.record_batch([pa.array(ids), column], schema=schema)
            else:
                if form == "frames":
                    frame = partial(integrity.guarded, decode_frame)  # a bad sample goes by on_error
                    results = pool.map(frame, ids.tolist(), chunksize=16) if pool else [frame(int(i)) for i in ids]
                    decoded = integrity.keep_or_skip(dataset, ids, results, on_error, skipped,
                                                     lambda: (bytes(3), (1, 1, 1, 1)))
                    dims = np.array([d for _, d in decoded], np.int32).reshape(-1, len(FRAME_FIELDS))
                    columns = [pa.array(ids), pa.array(dataset.labels[ids]), *(pa.array(dims[:, j]) for j in
                               range(len(FRAME_FIELDS))), pa.array([b for b, _ in decoded], type=pa.large_binary())]
                    yield pa.record_batch(columns, schema=schema)
                    if progress is not None:
                        progress(int(ids[-1]) + 1, n)
                    continue
                if form == "decoded":
                    decode = partial(integrity.guarded, decode_centre)
                    results = pool.map(decode, ids.tolist(), chunksize=16) if pool else [decode(int(i)) for i in ids]
                    blobs = integrity.keep_or_skip(dataset, ids, results, on_error, skipped, lambda: bytes(square))
                    column = pa.array(blobs, type=pa.binary(square))
                elif form == "reencoded":  # a bad sample goes by on_error: an empty row, reported unreadable
                    encode = partial(integrity.guarded, reencode_sample)
                    results = pool.map(encode, ids.tolist(), chunksize=4) if pool else [encode(int(i)) for i in ids]
                    column = pa.array(integrity.keep_or_skip(dataset, ids, results, on_error, skipped, bytes),
                                      type=pa.binary())
                else:  # a sample that is no image (its header unreadable) goes by on_error, as reencoded's
                    encode = partial(integrity.guarded, encode_sample)
                    results = pool.map(encode, ids.tolist(), chunksize=16) if pool else [encode(int(i)) for i in ids]
                    column = pa.array(integrity.keep_or_skip(dataset, ids, results, on_error, skipped, bytes),
                                      type=pa.binary())
                yield pa.record_batch([pa.array(ids), pa.array(dataset.labels[ids]), column], schema=schema)
            if progress is not None:
                progress(int(ids[-1]) + 1, n)
    finally:
        decode_pool.stop(pool)


class _ShardWriter:
    """One Arrow shard being written under a temporary name: its record batches, rows and skipped samples."""

    def __init__(self, work: Path, k: int, first: int, schema: pa.Schema) -> None:
        self.work, self.k, self.first, self.schema = work, k, first, schema
        self.tmp = work / f".{shard_name(k)}.{os.getpid()}.tmp"
        self.sink = pa.OSFile(str(self.tmp), "wb")
        self.writer = pa.ipc.new_file(self.sink, schema)
        self.samples = self.batches = 0
        self.skipped: list = []

    def add(self, batch: pa.RecordBatch, skipped: list) -> None:
        first = self.first + self.samples
        mine = [s for s in skipped if first <= int(s[0]) < first + batch.num_rows]
        self.writer.write_batch(batch, custom_metadata=batch_metadata(batch, mine))
        self.samples += batch.num_rows
        self.batches += 1
        self.skipped += mine

    def size(self) -> int:
        return self.sink.tell()

    def finish(self, bounds: np.ndarray) -> dict:
        """Close, read back (every chunk against its checksums), rename; the entry written last."""
        self.writer.close()
        self.sink.close()
        back = read_shard(self.tmp, self.schema)
        if len(back) != self.batches or sum(b.num_rows for b, _ in back) != self.samples:
            raise OSError(f"{self.tmp}: reads back {len(back)} record batches, {self.batches} were written")
        for b, (batch, extra) in enumerate(back):
            sums = json.loads(extra["loadopt.checksums"])["regions"]
            if json.loads(batch_metadata(batch, [])["loadopt.checksums"])["regions"] != sums:
                raise OSError(f"{self.tmp}: record batch {b} reads back other bytes than were written (a failing "
                              "disk or a concurrent writer)")
        nbytes = self.tmp.stat().st_size
        os.replace(self.tmp, self.work / shard_name(self.k))
        entry = {"shard": self.k, "first": self.first, "samples": self.samples, "bytes": nbytes,
                 "batches": self.batches, "skipped": self.skipped,
                 "source_shards": shard_work.source_span(bounds, self.first, self.samples)}
        shard_work.write_text(self.work / shard_work.entry_name(self.k), json.dumps(entry))
        return entry

    def abandon(self) -> None:
        try:
            self.writer.close()
            self.sink.close()
        except (OSError, pa.ArrowException):
            pass
        self.tmp.unlink(missing_ok=True)


def _write_shard(work: Path, job: shard_work.ShardJob, workers: int, written: Callable[[int], None] | None,
                 dataset, form: Form, size: int | None, on_error: str) -> dict:
    """Convert the samples of shard `job` into it (`workers` decode processes); its entry returned."""
    schema = arrow_schema(dataset, form, size)
    skipped: list = []
    progress = None if written is None else (lambda done, _total: written(done - job.start))
    writer = _ShardWriter(work, job.k, job.start, schema)
    try:
        for batch in record_batches(dataset, schema, form, size, progress, workers, on_error, skipped, job.start,
                                    job.stop):
            writer.add(batch, skipped)
        return writer.finish(shard_table(dataset).bounds)
    except BaseException:
        writer.abandon()
        raise


def _outlined(write: WriteShard, work: Path, job: shard_work.ShardJob, workers: int,
              written: Callable[[int], None] | None) -> dict:
    """`write`, then the shard's outline beside it (what the conversion's folder keeps of a remote shard)."""
    entry = write(work, job, workers, written)
    Outline.of(work / shard_name(job.k), with_bytes=True).save(work / outline_name(job.k))
    return entry


def _rewrite(batches: list, target: Path, k: int, segment: shard_work.Segment, schema: pa.Schema,
             labels: np.ndarray | None, skipped: list) -> None:
    """An earlier shard's record batches written again as shard `k` in `target`, its samples' new numbers and
    labels in them (their bytes as they are: nothing decoded)."""
    writer = _ShardWriter(target, k, segment.start, schema)
    try:
        at = segment.start
        for batch, _ in batches:
            ids = np.arange(at, at + batch.num_rows, dtype=np.int64)
            columns = [pa.array(ids)] + ([] if labels is None else
                                         [pa.array(labels[at - segment.start : at - segment.start + len(ids)])])
            writer.add(pa.record_batch(columns + batch.columns[len(columns):], schema=schema), skipped)
            at += batch.num_rows
        writer.writer.close()
        writer.sink.close()
        os.replace(writer.tmp, target / shard_name(k))
    except BaseException:
        writer.abandon()
        raise


def _reuse(work: Path, job: shard_work.ShardJob, dataset, form: Form, size: int | None,
           remote: remote_shards.RemoteShards | None) -> dict:
    """Shard k: an earlier conversion's shard of source shards that did not change: linked (not copied; on a remote
    home, copied there) where its samples keep their numbers and labels, else its record batches written again
    with the new ones (the earlier shard fetched first where its data is remote)."""
    k, segment = job.k, job.reused
    assert segment is not None and segment.reused is not None and segment.root is not None
    old, j = segment.root, int(segment.reused["shard"])
    schema = arrow_schema(dataset, form, size)
    labels = None if form == "tokens" else np.asarray(dataset.labels)[segment.start : segment.stop]
    whole = (old / shard_name(j)).exists()  # else its data is on the remote home, its outline here
    image = None if whole else Outline.load(old / outline_name(j)).image()
    batches = read_shard(old / shard_name(j), schema, image=image)
    same = segment.start == segment.reused["first"] and (
        labels is None or np.array_equal(np.concatenate([b.column(1).to_numpy() for b, _ in batches]), labels))
    skipped = shard_work.reused_skips(segment)
    nbytes = int(segment.reused["bytes"])
    if remote is None:
        if same:
            shard_work.link(old / shard_name(j), work / shard_name(k))
        else:
            _rewrite(batches, work, k, segment, schema, labels, skipped)
        nbytes = (work / shard_name(k)).stat().st_size
    elif same and whole:  # an earlier conversion kept whole on this disk
        remote.upload(old / shard_name(j), shard_name(k))
        Outline.of(old / shard_name(j), with_bytes=True).save(work / outline_name(k))
    elif same:
        earlier = remote_shards.destination(dataset, old)
        assert earlier is not None, "a conversion for a remote home follows one for the same home"
        remote.copy(earlier, shard_name(j), shard_name(k))
        shard_work.link(old / outline_name(j), work / outline_name(k))
    else:
        with remote_shards.scratch(f"reuse-{k}") as folder:
            if not whole:
                earlier = remote_shards.destination(dataset, old)
                assert earlier is not None, "a conversion for a remote home follows one for the same home"
                earlier.download(shard_name(j), folder / f"earlier-{shard_name(j)}")
                batches = read_shard(folder / f"earlier-{shard_name(j)}", schema)
            _rewrite(batches, folder, k, segment, schema, labels, skipped)
            remote.upload(folder / shard_name(k), shard_name(k))
            Outline.of(folder / shard_name(k), with_bytes=True).save(work / outline_name(k))
            nbytes = (folder / shard_name(k)).stat().st_size
    entry = {**segment.reused, "shard": k, "first": segment.start, "skipped": skipped, "kept_from": old.name,
             "bytes": nbytes, "source_shards": shard_work.source_span(shard_table(dataset).bounds, segment.start,
                                                                       segment.stop - segment.start)}
    shard_work.write_text(work / shard_work.entry_name(k), json.dumps(entry))
    return entry


def _intact(work: Path, remote_sizes: dict[str, int] | None, k: int, entry: dict) -> bool:
    if remote_sizes is None:
        return (work / shard_name(k)).stat().st_size == entry["bytes"]
    return remote_sizes.get(shard_name(k)) == entry["bytes"] and (work / outline_name(k)).exists()


def reference_names(meta: dict) -> list[str]:
    """An Arrow conversion's files besides its shard data and manifest: each shard's outline."""
    return [outline_name(k) for k in range(len(meta["shard_table"]))]


def data_home(dataset, final: Path) -> remote_shards.RemoteShards | None:
    """Where the shard data of the finished conversion `final` is when `final` holds its reference only."""
    return remote_shards.data_home(dataset, final, "Arrow conversion", shard_name)


def _images(folder: Path, remote: remote_shards.RemoteShards, tier: fsspec.AbstractFileSystem | None = None,
            threads: int = 8) -> tier_reads.ShadowShards:
    """The shards of the conversion in `folder` whose data is in `remote`, as images from their outlines, their
    samples read through `tier` (the remote filesystem itself by default)."""
    shards = len(shard_work.read_manifest(folder, "Arrow conversion")["shard_table"])
    outlines = [Outline.load(folder / outline_name(k)) for k in range(shards)]
    return tier_reads.ShadowShards(tier or remote.fs, [remote.path(shard_name(k)) for k in range(shards)], outlines,
                                   threads)


def _check_outlines(final: Path, verify: integrity.Verify) -> None:
    """The outlines of the conversion `final` (its reference, the shards' data elsewhere) against the manifest's
    CRC-32s, before they are read: every one (`all`) or a random few (`sample`)."""
    if verify == "none":
        return
    files = shard_work.read_manifest(final, "Arrow conversion").get("files") or {}
    names = sorted(files)
    picked = [names[i] for i in integrity.chunks_to_check(len(names), verify)]
    integrity.check_files(final, files, picked, "arrow")


def open_conversion(dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB,
                    tier: fsspec.AbstractFileSystem | None = None, threads: int = 8, **checks) -> ArrowConversion:
    """The finished Arrow conversion of `dataset` opened (`open_arrow`, `checks` its options), its reference
    fetched from the conversions' remote home first when this machine has none; where its data is there, the
    shards are opened from their outlines and their samples read through `tier` (`threads` at a time)."""
    final = arrow_path(dataset, form, size, shard_mib)
    remote_shards.fetch_reference(dataset, final, reference_names)
    data = data_home(dataset, final)
    if data is None:
        return open_arrow(final, dataset, form, size, shard_mib, **checks)
    if remote_shards.moved_away(data):
        raise DatasetError(f"{final}: the reference of an Arrow conversion whose shards are not at {data.where()} "
                           "(storage.converted changed since); convert it there with `loadopt convert CONFIG --to "
                           "arrow ...`")
    _check_outlines(final, checks.get("verify", "sample"))
    return open_arrow(final, dataset, form, size, shard_mib, images=_images(final, data, tier, threads), **checks)


def convert(dataset, form: Form, size: int | None = None, shard_mib: float = DEFAULT_SHARD_MIB,
            progress: Callable[[int, int], None] | None = None, workers: int | None = None, *,
            on_error: str = "raise", force: bool = False, verify: bool = False,
            engine: ConvertEngine = LOCAL) -> Path:
    """Convert `dataset` to its Arrow form (or reuse the finished conversion); returns the folder. A conversion
    stopped part way resumes from its finished shards.

    `on_error` is the dataset's policy for samples that cannot be decoded; `force` rebuilds a finished
    conversion; `verify` checks every chunk of a finished one (damage raises, naming the shard) and the
    source's content against the digest it recorded, reconverting when the source changed. `engine` writes the
    planned shards: this process, or a Ray cluster."""
    final = arrow_path(dataset, form, size, shard_mib)
    integrity.remove_dead_temps(final.parent)  # what a killed conversion left, whatever this one does
    remote_shards.fetch_reference(dataset, final, reference_names)  # made on another machine for the same home
    done = final / shard_work.MANIFEST
    force = force or (done.exists() and remote_shards.converted_elsewhere_since(final, data_home(dataset, final)))
    if done.exists() and not force and not verify:
        return final
    with running(engine):  # Ray joined or started for the digest and the shards, stopped after
        # The source's content, recorded with the conversion: read once more, so only where that is cheap
        # (a local disk) or asked for (--verify).
        # (records: their fingerprint has each file's name, size and mtime; a sample is not a stored blob)
        cores = workers or os.cpu_count() or 1
        digest = source_digest(dataset, engine, cores) if form not in ("tokens", "records") and \
            (verify or dataset.is_local()) else ""
        if done.exists() and not force:
            try:  # every chunk of every column and every outline
                if open_conversion(dataset, form, size, shard_mib, verify="all").source_content == digest:
                    return final
                log.warning("%s: the source's content differs from the converted one's: converting again", final)
            except integrity.DamagedConversion as exc:
                log.warning("%s: converting again", exc.finding())
                force = True  # nothing taken from the earlier conversions: a shard of theirs may be linked here
        key = conversion_key(dataset, form, size, shard_mib)
        line = shard_work.lineage(key, dataset)
        table = shard_work.source_table(dataset)
        earlier = shard_work.predecessor(final, line) if table and not force else None
        jobs = shard_work.plan_shards(shard_work.plan(len(dataset), table, earlier), stored_sizes(dataset, form, size),
                                      shard_table(dataset).bounds, shard_bytes(shard_mib))
        write: WriteShard = partial(_write_shard, dataset=dataset, form=form, size=size, on_error=on_error)
        remote = remote_shards.writable_destination(dataset, final)
        if remote is not None:  # each shard's data uploaded by its writer; its outline kept here
            write = partial(remote_shards.write_and_upload, partial(_outlined, write), remote, shard_name)
            remote.unfinish()
        reuse = partial(_reuse, dataset=dataset, form=form, size=size, remote=remote)

        def check(folder: Path) -> ArrowConversion:
            images = None if remote is None else _images(folder, remote)
            return open_arrow(folder, dataset, form, size, shard_mib, verify_labels=True, verify="none", images=images)

        built = shard_work.build(
            final, {"key": key, "source_content": digest, "earlier": earlier[0].name if earlier else None},
            f"the Arrow conversion ({form})", needed_bytes(dataset, form, size), form == "frames", force or verify,
            write=lambda folder: write_shards(
                folder, jobs, partial(_intact, folder, remote.sizes() if remote else None), write, reuse, engine,
                cores, progress, receive=remote_shards.receive if remote else None),
            manifest=lambda entries: {**key, "source_content": digest, "lineage": line, "source_table": table,
                                      "skipped": [s for e in entries for s in e["skipped"]], "shard_table": entries,
                                      "files": integrity.file_sums(shard_work.work_folder(final),
                                                                   reference_names({"shard_table": entries}))},
            check=check)
        if remote is not None:
            remote_shards.publish(dataset, built, remote)  # the reference beside the data, its manifest last
        return built
