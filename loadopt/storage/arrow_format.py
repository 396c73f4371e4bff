"""The Arrow form of a dataset: one uncompressed Arrow IPC file, record batches of a fixed row count.

Forms (columns):
- `encoded`: sample_id, label, jpeg (the stored bytes, as read from the source);
- `decoded`: sample_id, label, pixels (uint8 HWC, `size` x `size`: the shorter side resized to
  `size`, then centre-cropped; fixed-size binary, so a record batch is one contiguous pixel array);
- `tokens`: sample_id, window (seq_len + 1 token ids, fixed-size binary).

A conversion is keyed by the source's fingerprint and the conversion settings, written under a
temporary name, verified (row count, labels) and renamed: an interrupted one is never used, a
finished one is reused, and the source is only ever read.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from loadopt.config import cache_dir
from loadopt.errors import DatasetError

FORMAT_VERSION = 1
ROWS_PER_BATCH = 1024
Form = Literal["encoded", "decoded", "tokens"]


def arrow_path(dataset, form: Form, size: int | None) -> Path:
    """Where the conversion of `dataset` to `form` lives in the cache."""
    settings = {"version": FORMAT_VERSION, "source": dataset.fingerprint, "form": form, "size": size,
                "seq_len": getattr(dataset, "seq_len", None), "rows": ROWS_PER_BATCH}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "arrow" / f"{dataset.fingerprint}-{form}-{key}.arrow"


def _schema(dataset, form: Form, size: int | None) -> pa.Schema:
    metadata = {"loadopt.form": form, "loadopt.source": dataset.fingerprint, "loadopt.rows": str(len(dataset))}
    if form == "tokens":
        width = (dataset.seq_len + 1) * dataset.tokens.itemsize
        metadata.update({"loadopt.seq_len": str(dataset.seq_len), "loadopt.dtype": str(dataset.tokens.dtype)})
        return pa.schema([("sample_id", pa.int64()), ("window", pa.binary(width))], metadata=metadata)
    if form == "decoded":
        metadata["loadopt.size"] = str(size)
        column = ("pixels", pa.binary(size * size * 3))
    else:
        column = ("jpeg", pa.binary())
    return pa.schema([("sample_id", pa.int64()), ("label", pa.int64()), column], metadata=metadata)


# Decoding for the `decoded` form runs in a process pool; forked workers inherit these.
_POOL_DATASET = None
_POOL_SIZE = 0


def _decode_one(index: int) -> bytes:
    from PIL import Image

    from loadopt.loaders import transforms

    pixels = transforms.decode_array(_POOL_DATASET.read(index), "simplejpeg")
    height, width = pixels.shape[:2]
    box = transforms.center_crop_box(width, height, fraction=1.0)
    out = Image.fromarray(pixels).resize((_POOL_SIZE, _POOL_SIZE), Image.BILINEAR, box=box)
    return out.tobytes()


def _record_batches(dataset, schema: pa.Schema, form: Form, size: int | None, progress, workers: int):
    n = len(dataset)
    pool = None
    if form == "decoded":
        _set_pool_globals(dataset, size)
        if workers > 1:
            pool = multiprocessing.get_context("fork").Pool(workers)
    try:
        for start in range(0, n, ROWS_PER_BATCH):
            ids = np.arange(start, min(n, start + ROWS_PER_BATCH), dtype=np.int64)
            if form == "tokens":
                windows = np.ascontiguousarray(dataset.windows()[ids])
                column = pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(windows.shape[1] * windows.itemsize), len(ids), [None, pa.py_buffer(windows)])
                yield pa.record_batch([pa.array(ids), column], schema=schema)
            else:
                if form == "decoded":
                    blobs = pool.map(_decode_one, ids.tolist(), chunksize=16) if pool else \
                        [_decode_one(int(i)) for i in ids]
                    column = pa.array(blobs, type=pa.binary(size * size * 3))
                else:
                    column = pa.array([dataset.read(int(i)) for i in ids], type=pa.binary())
                yield pa.record_batch([pa.array(ids), pa.array(dataset.labels[ids]), column], schema=schema)
            if progress is not None:
                progress(int(ids[-1]) + 1, n)
    finally:
        if pool is not None:
            pool.terminate()


def _set_pool_globals(dataset, size) -> None:
    global _POOL_DATASET, _POOL_SIZE
    _POOL_DATASET, _POOL_SIZE = dataset, size


def convert(dataset, form: Form, size: int | None = None, progress: Callable[[int, int], None] | None = None,
            workers: int | None = None) -> Path:
    """Convert `dataset` to its Arrow form (or reuse the finished conversion); returns the file."""
    final = arrow_path(dataset, form, size)
    if final.exists():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        os.close(fd)
    except OSError as exc:
        raise DatasetError(f"{final.parent}: cannot write the Arrow conversion ({exc.strerror or exc})") from None
    try:
        schema = _schema(dataset, form, size)
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in _record_batches(dataset, schema, form, size, progress, workers or os.cpu_count() or 1):
                writer.write_batch(batch)
        open_arrow(tmp, dataset, form, size, verify_labels=True)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def open_arrow(path: str | Path, dataset, form: Form, size: int | None, verify_labels: bool = False):
    """Memory-map an Arrow form and check it matches `dataset` and the settings; returns the reader."""
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except FileNotFoundError:
        raise DatasetError(f"{path}: Arrow file not found") from None
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise DatasetError(f"{path}: corrupt or truncated Arrow file ({str(exc).splitlines()[0]})") from None
    expected = _schema(dataset, form, size)
    if not reader.schema.remove_metadata().equals(expected.remove_metadata()):
        raise DatasetError(f"{path}: schema does not match the config: has {_describe(reader.schema)}, "
                           f"expected {_describe(expected)}")
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    for key, value in (expected.metadata or {}).items():
        if meta.get(key.decode()) != value.decode():
            raise DatasetError(f"{path}: {key.decode()} is {meta.get(key.decode())!r}, the config needs "
                               f"{value.decode()!r}")
    rows = sum(b.num_rows for b in batches)
    if rows != len(dataset) or any(b.num_rows != ROWS_PER_BATCH for b in batches[:-1]):
        raise DatasetError(f"{path}: {rows} rows in record batches of uneven size; expected {len(dataset)} rows "
                           f"in batches of {ROWS_PER_BATCH}")
    if verify_labels and form != "tokens":
        labels = np.concatenate([b.column(1).to_numpy() for b in batches])
        if not np.array_equal(labels, dataset.labels):
            raise DatasetError(f"{path}: labels differ from the source dataset's")
    return batches


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{field.name}: {field.type}" for field in schema)
