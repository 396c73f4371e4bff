"""The Arrow form of a dataset: one uncompressed Arrow IPC file, record batches of a fixed row count.

Forms (columns):
- `encoded`: sample_id, label, jpeg (the stored bytes, as read from the source);
- `reencoded`: the `encoded` columns, a source whose longer side is over `size` = `pipeline.max_side`
  re-encoded as a JPEG at <= size (quality `REENCODE_QUALITY`, as FFCV's .beton jpg mode stores it), the
  others their own bytes (`imaging.reencode.bounded_jpeg`);
- `decoded`: sample_id, label, pixels (uint8 HWC, `size` x `size`: the shorter side resized to
  `size`, then centre-cropped; fixed-size binary, so a record batch is one contiguous pixel array);
- `frames`: sample_id, label, height, width, source_height, source_width (int32), pixels (uint8 HWC,
  the whole frame with its longer side at most `size` = `pipeline.max_side`; variable-length large
  binary: the rows' offsets index the contiguous pixel data. Padding every frame to size x size
  instead would store 1.6-1.9x the bytes of the default dataset);
- `tokens`: sample_id, window (seq_len + 1 token ids, fixed-size binary);
- `records`: sample_id, label, record (each record's stored bytes whole, storage/records.py; variable-length
  large binary: record sizes spread per file). Record batches hold as many records as fit in
  `RECORD_BATCH_BYTES` (at least one), not `ROWS_PER_BATCH`: 1,024 of MLPerf Storage's 140 MB unet3d samples
  would be one 140 GB batch in memory while writing.

A conversion is keyed by the source's fingerprint and the conversion settings, written under a
temporary name, verified (row count, labels) and renamed: an interrupted one is never used, a
finished one is reused, and the source is only ever read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from loadopt.errors import DatasetError
from loadopt.files import cache_dir, is_no_space
from loadopt.imaging.frames import FRAME_FIELDS, FrameDims, centre_square, stored_frame
from loadopt.imaging.reencode import REENCODE_QUALITY, bounded_jpeg, restarts_key, with_restarts
from loadopt.storage import decode_pool, integrity
from loadopt.storage.tier_reads import local_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: chunk checksums and skipped samples in each record batch's custom metadata
ROWS_PER_BATCH = 1024
RECORD_BATCH_BYTES = 256 << 20  # the records form: about this many bytes of records per record batch
Form = Literal["encoded", "reencoded", "decoded", "frames", "tokens", "records"]


def rows_per_batch(dataset, form: Form) -> int:
    """Rows of each record batch but the last: `ROWS_PER_BATCH`, or for records as many of the largest as
    fit in `RECORD_BATCH_BYTES`."""
    if form != "records":
        return ROWS_PER_BATCH
    largest = int(dataset.sizes.max()) if len(dataset) else 1
    return int(max(1, min(ROWS_PER_BATCH, RECORD_BATCH_BYTES // max(1, largest))))


def arrow_path(dataset, form: Form, size: int | None) -> Path:
    """Where the conversion of `dataset` to `form` lives in the cache."""
    settings = {"version": FORMAT_VERSION, "source": dataset.fingerprint, "form": form, "size": size,
                "seq_len": getattr(dataset, "seq_len", None), "rows": rows_per_batch(dataset, form)}
    if form == "reencoded":
        settings["quality"] = REENCODE_QUALITY
    if form in ("encoded", "reencoded"):
        settings["restarts"] = restarts_key()
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    # the cache, or `storage.converted` / beside the source (storage/tier_reads.py)
    return local_dir(dataset, cache_dir()) / "arrow" / f"{dataset.fingerprint}-{form}-{key}.arrow"


def _square_bytes(size: int | None) -> int:
    """Bytes of one `decoded` row: a size x size HWC uint8 square."""
    if size is None:
        raise ValueError("the decoded form is stored at a size: none was given")
    return size * size * 3


def _schema(dataset, form: Form, size: int | None) -> pa.Schema:
    metadata = {"loadopt.form": form, "loadopt.source": dataset.fingerprint, "loadopt.rows": str(len(dataset))}
    if form == "tokens":
        width = (dataset.seq_len + 1) * dataset.tokens.itemsize
        metadata.update({"loadopt.seq_len": str(dataset.seq_len), "loadopt.dtype": str(dataset.tokens.dtype)})
        return pa.schema([("sample_id", pa.int64()), ("window", pa.binary(width))], metadata=metadata)
    if form == "records":
        metadata["loadopt.rows_per_batch"] = str(rows_per_batch(dataset, form))
        column = ("record", pa.large_binary())
    elif form == "decoded":
        metadata["loadopt.size"] = str(size)
        column = ("pixels", pa.binary(_square_bytes(size)))
    elif form == "frames":
        metadata["loadopt.max_side"] = str(size)
        dims = [(name, pa.int32()) for name in FRAME_FIELDS]
        return pa.schema([("sample_id", pa.int64()), ("label", pa.int64()), *dims, ("pixels", pa.large_binary())],
                         metadata=metadata)
    else:
        if form == "reencoded":
            metadata.update({"loadopt.max_side": str(size), "loadopt.jpeg_quality": str(REENCODE_QUALITY)})
        column = ("jpeg", pa.binary())
    return pa.schema([("sample_id", pa.int64()), ("label", pa.int64()), column], metadata=metadata)


# Decoding for the `decoded`, `frames` and `reencoded` forms runs in a process pool; forked workers inherit these.
_POOL_DATASET = None
_POOL_SIZE = 0


def set_pool_dataset(dataset, size: int | None) -> None:
    """The dataset and size the pool's decode functions read (set before the pool forks)."""
    global _POOL_DATASET, _POOL_SIZE
    _POOL_DATASET, _POOL_SIZE = dataset, size or 0


def _pool_sample(index: int) -> bytes:
    if _POOL_DATASET is None:
        raise RuntimeError("set_pool_dataset was not called before decoding")
    return _POOL_DATASET.read(index)


def decode_centre(index: int) -> bytes:
    """The `decoded` form of one sample of the pool's dataset (`imaging.frames.centre_square`)."""
    return centre_square(_pool_sample(index), _POOL_SIZE)


def decode_frame(index: int) -> tuple[bytes, FrameDims]:
    """The `frames` form of one sample of the pool's dataset (`imaging.frames.stored_frame`)."""
    return stored_frame(_pool_sample(index), _POOL_SIZE)


def encode_sample(index: int) -> bytes:
    """The `encoded` form of one sample of the pool's dataset: its JPEG with restart markers (lossless,
    `imaging.reencode.with_restarts`), anything else as it is."""
    return with_restarts(_pool_sample(index))


def reencode_sample(index: int) -> bytes:
    """The `reencoded` form of one sample of the pool's dataset (`imaging.reencode.bounded_jpeg`)."""
    return bounded_jpeg(_pool_sample(index), _POOL_SIZE)


def _record_batches(dataset, schema: pa.Schema, form: Form, size: int | None, progress, workers: int,
                    on_error: str = "raise", skipped: list | None = None):
    """The record batches of the conversion; samples that cannot be decoded go by `on_error` (`skip`:
    a zero row, its `[index, reason]` appended to `skipped`)."""
    n = len(dataset)
    skipped = [] if skipped is None else skipped
    pool = None
    square = _square_bytes(size) if form == "decoded" else 0  # bytes of a decoded row
    if form == "reencoded" and not size:
        raise ValueError("the reencoded form is bounded by a max side: none was given")
    if form in ("decoded", "frames", "reencoded", "encoded"):
        set_pool_dataset(dataset, size)
        pool = decode_pool.start(workers)
    step = rows_per_batch(dataset, form)
    try:
        for start in range(0, n, step):
            ids = np.arange(start, min(n, start + step), dtype=np.int64)
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
                else:
                    blobs = pool.map(encode_sample, ids.tolist(), chunksize=16) if pool else [
                        encode_sample(int(i)) for i in ids]
                    column = pa.array(blobs, type=pa.binary())
                yield pa.record_batch([pa.array(ids), pa.array(dataset.labels[ids]), column], schema=schema)
            if progress is not None:
                progress(int(ids[-1]) + 1, n)
    finally:
        decode_pool.stop(pool)


def convert(dataset, form: Form, size: int | None = None, progress: Callable[[int, int], None] | None = None,
            workers: int | None = None, *, on_error: str = "raise", force: bool = False, verify: bool = False) -> Path:
    """Convert `dataset` to its Arrow form (or reuse the finished conversion); returns the file.

    `on_error` is the dataset's policy for samples that cannot be decoded; `force` rebuilds a finished
    conversion; `verify` checks every chunk of a finished one (damage raises, naming the chunk) and the
    source's content against the digest it recorded, reconverting when the source changed."""
    final = arrow_path(dataset, form, size)
    integrity.remove_dead_temps(final.parent)  # what a killed conversion left, whatever this one does
    if final.exists() and not force and not verify:
        return final
    # The source's content, recorded with the conversion: read once more, so only where that is cheap
    # (a local disk) or asked for (--verify).
    # (records: their fingerprint has each file's name, size and mtime; a sample is not a stored blob)
    digest = integrity.source_digest(dataset) if form not in ("tokens", "records") and \
        (verify or dataset.is_local()) else ""
    if final.exists() and not force:
        if open_arrow(final, dataset, form, size, verify="all").source_content == digest:
            return final
        log.warning("%s: the source's content differs from the converted one's: converting again", final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = integrity.temp_path(final)
        tmp.touch(exist_ok=False)
    except OSError as exc:
        if is_no_space(exc):
            raise integrity.no_space_error(final.parent, needed_bytes(dataset, form, size),
                                           f"the Arrow conversion ({form})", form == "frames") from None
        raise DatasetError(f"{final.parent}: cannot write the Arrow conversion ({exc.strerror or exc}); "
                           "set storage.converted to a writable folder") from None
    try:
        schema = _schema(dataset, form, size)
        schema = schema.with_metadata({**schema.metadata, b"loadopt.source_content": digest.encode()})
        skipped: list = []
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in _record_batches(dataset, schema, form, size, progress, workers or os.cpu_count() or 1,
                                         on_error, skipped):
                first = int(batch.column(0)[0].as_py())
                mine = [s for s in skipped if s[0] >= first]
                writer.write_batch(batch, custom_metadata=batch_metadata(batch, mine))
        open_arrow(tmp, dataset, form, size, verify_labels=True, verify="none")
        os.replace(tmp, final)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_no_space(exc):
            raise integrity.no_space_error(final.parent, needed_bytes(dataset, form, size),
                                           f"the Arrow conversion ({form})", form == "frames") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def needed_bytes(dataset, form: Form, size: int | None) -> int:
    """About the bytes of the Arrow form of `dataset` (for the message when the disk is full)."""
    if form == "tokens":
        return len(dataset) * (dataset.seq_len + 1) * dataset.tokens.itemsize
    if form in ("decoded", "frames"):
        return len(dataset) * (size or 0) ** 2 * 3
    return int(dataset.sizes.sum())


def _regions(batch: pa.RecordBatch) -> list[tuple[str, memoryview]]:
    """The bytes of each column of a record batch, as written (not as allocated: padding is not data)."""
    regions = []
    for field, column in zip(batch.schema, batch.columns, strict=True):
        buffers, n, first = column.buffers(), len(column), column.offset
        kind = column.type
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            dtype = np.int64 if pa.types.is_large_binary(kind) else np.int32
            offsets = np.frombuffer(buffers[1], dtype, n + 1, first * np.dtype(dtype).itemsize)
            regions.append((f"{field.name}.lengths", np.diff(offsets).data))
            regions.append((field.name, memoryview(buffers[2])[int(offsets[0]):int(offsets[-1])]))
        else:
            width = kind.byte_width
            regions.append((field.name, memoryview(buffers[1])[first * width:(first + n) * width]))
    return regions


def batch_metadata(batch: pa.RecordBatch, skipped: list) -> dict[str, str]:
    """A record batch's custom metadata: its chunk checksums and its samples that were skipped."""
    sums = {name: integrity.chunk_sums(view) for name, view in _regions(batch)}
    return {"loadopt.checksums": json.dumps({"algorithm": integrity.ALGORITHM, "chunk_bytes": integrity.CHUNK_BYTES,
                                             "regions": sums}),
            "loadopt.skipped": json.dumps(skipped)}


class ArrowConversion(list):
    """The record batches of an opened Arrow form, with what its metadata says: each batch's chunk
    checksums, the samples the conversion skipped (index -> reason) and the source's content digest."""

    def __init__(self, path: Path, batches: list, checksums: list[dict | None], skipped: dict[int, str],
                 source_content: str) -> None:
        super().__init__(batches)
        self.path, self.checksums, self.skipped, self.source_content = path, checksums, skipped, source_content

    def check(self, verify: integrity.Verify, records: list[int] | None = None) -> None:
        """Check the chunks `verify` asks for (of the given record batches, else of all) against their
        checksums; damage raises `DatasetError` naming the file, the record batch and the bytes."""
        import zlib

        records = list(range(len(self))) if records is None else records
        chunks = []
        for b in records:
            sums = self.checksums[b]
            if sums is None:
                raise DatasetError(f"{self.path}: record batch {b} has no checksums (a damaged or foreign file): "
                                   "rebuild it with `loadopt convert CONFIG --force ...`")
            # A sample draws from the samples' column (where the bytes are); "all" checks every column.
            samples = self[b].schema.names[-1]
            for name, view in _regions(self[b]):
                if verify == "all" or name == samples:
                    chunks += [(b, name, view, k, crc) for k, crc in enumerate(sums.get(name, []))]
        for position in integrity.chunks_to_check(len(chunks), verify if records else "none"):
            b, name, view, k, crc = chunks[position]
            at = k * integrity.CHUNK_BYTES
            if zlib.crc32(view[at:at + integrity.CHUNK_BYTES]) != crc:
                first = b * ROWS_PER_BATCH
                raise integrity.damaged(f"{self.path}: record batch {b} (samples {first}-"
                                        f"{first + self[b].num_rows - 1}), chunk {k} of column {name} (bytes "
                                        f"{at}-{min(at + integrity.CHUNK_BYTES, len(view))})")


def open_arrow(path: str | Path, dataset, form: Form, size: int | None, verify_labels: bool = False,
               verify: integrity.Verify = "sample") -> ArrowConversion:
    """Memory-map an Arrow form and check it matches `dataset` and the settings, and the chunks that
    `verify` asks for (a random few by default) match their checksums; returns its record batches."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        pairs = [reader.get_batch_with_custom_metadata(i) for i in range(reader.num_record_batches)]
    except FileNotFoundError:
        raise DatasetError(f"{path}: Arrow file not found") from None
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise DatasetError(f"{path}: corrupt or truncated Arrow file ({str(exc).splitlines()[0]})") from None
    batches = [b for b, _ in pairs]
    expected = _schema(dataset, form, size)
    if not reader.schema.remove_metadata().equals(expected.remove_metadata()):
        raise DatasetError(f"{path}: schema does not match the config: has {_describe(reader.schema)}, "
                           f"expected {_describe(expected)}")
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    for key, value in (expected.metadata or {}).items():
        if meta.get(key.decode()) != value.decode():
            raise DatasetError(f"{path}: {key.decode()} is {meta.get(key.decode())!r}, the config needs "
                               f"{value.decode()!r}")
    rows, step = sum(b.num_rows for b in batches), rows_per_batch(dataset, form)
    if rows != len(dataset) or any(b.num_rows != step for b in batches[:-1]):
        raise DatasetError(f"{path}: {rows} rows in record batches of uneven size; expected {len(dataset)} rows "
                           f"in batches of {step}")
    if verify_labels and form != "tokens":
        labels = np.concatenate([b.column(1).to_numpy() for b in batches])
        if not np.array_equal(labels, dataset.labels):
            raise DatasetError(f"{path}: labels differ from the source dataset's")
    checksums, skipped = [], {}
    for b, custom in enumerate(pairs):
        extra = {k.decode(): v.decode() for k, v in (custom[1] or {}).items()}
        try:
            checksums.append(json.loads(extra["loadopt.checksums"])["regions"])
            skipped.update({int(i): str(why) for i, why in json.loads(extra.get("loadopt.skipped", "[]"))})
        except (KeyError, ValueError, TypeError):
            checksums.append(None)
            if verify != "none":
                raise DatasetError(f"{path}: record batch {b} has no readable checksums (a damaged or foreign "
                                   "file): rebuild it with `loadopt convert CONFIG --force ...`") from None
    conversion = ArrowConversion(Path(path), batches, checksums, skipped, meta.get("loadopt.source_content", ""))
    conversion.check(verify)
    return conversion


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{field.name}: {field.type}" for field in schema)
