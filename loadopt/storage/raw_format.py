"""The raw shard form of a dataset: samples packed into large flat files, each at a 4 KiB boundary.

A folder per conversion holds `shard-00000.bin`, ... (about `shard_mib` MiB each) and `index.npz`:
a structured array (sample_id, shard, offset, length, label) and the conversion's metadata as JSON
(form, source fingerprint, rows, decoded size and HWC shape, token dtype and window length).
Every sample starts at a multiple of 4096 and every shard is padded to one, so a reader can fetch
any run of samples with O_DIRECT (aligned offset, length and buffer) or cuFile without a bounce.

Forms: `encoded` (the stored JPEG bytes), `decoded` (uint8 HWC pixels, the very bytes of the Arrow
decoded form: same decode function), `tokens` (windows of seq_len + 1 token ids).
Conversion rules are the Arrow form's: keyed by source fingerprint and settings, written in a
temporary folder, verified, renamed; an interrupted conversion is never used.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadopt.config import cache_dir
from loadopt.errors import DatasetError
from loadopt.storage import arrow_format
from loadopt.storage.arrow_format import Form

FORMAT_VERSION = 1
ALIGN = 4096
DEFAULT_SHARD_MIB = 256.0
INDEX_DTYPE = np.dtype([("sample_id", "<i8"), ("shard", "<i4"), ("offset", "<i8"), ("length", "<i8"),
                        ("label", "<i8")])


def align_up(n: np.ndarray | int) -> np.ndarray | int:
    """`n` rounded up to the next multiple of 4096."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def shard_bytes(shard_mib: float) -> int:
    return max(ALIGN, int(align_up(int(shard_mib * (1 << 20)))))


def _meta(dataset, form: Form, size: int | None, shard_mib: float) -> dict:
    meta = {"version": FORMAT_VERSION, "form": form, "source": dataset.fingerprint, "rows": len(dataset),
            "shard_bytes": shard_bytes(shard_mib), "size": size, "shape": None, "dtype": "uint8", "seq_len": None}
    if form == "decoded":
        meta["shape"] = [size, size, 3]
    if form == "tokens":
        meta.update(seq_len=dataset.seq_len, shape=[dataset.seq_len + 1], dtype=str(dataset.tokens.dtype))
    return meta


def raw_path(dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB) -> Path:
    """The folder of the conversion of `dataset` to `form` in the cache."""
    key = hashlib.sha256(json.dumps(_meta(dataset, form, size, shard_mib), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "raw" / f"{dataset.fingerprint}-{form}-{key}"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


@dataclass
class RawIndex:
    """An opened conversion: its shard files and one index row per sample."""

    root: Path
    shards: list[Path]
    index: np.ndarray  # INDEX_DTYPE, row i = sample i
    meta: dict

    def __post_init__(self) -> None:
        self.shard = self.index["shard"].astype(np.int64)
        self.offset = self.index["offset"]
        self.length = self.index["length"]


def _samples(dataset, form: Form, size: int | None, workers: int) -> Iterator[bytes]:
    n = len(dataset)
    if form == "tokens":
        windows = dataset.windows()
        for i in range(n):
            yield windows[i].tobytes()
    elif form == "encoded":
        for i in range(n):
            yield dataset.read(i)
    else:  # the Arrow decoded form's own decode function: bit-equal pixels in both forms
        arrow_format._set_pool_globals(dataset, size)
        if workers <= 1:
            for i in range(n):
                yield arrow_format._decode_one(i)
            return
        pool = multiprocessing.get_context("fork").Pool(workers)
        try:
            yield from pool.imap(arrow_format._decode_one, range(n), chunksize=16)
        finally:
            pool.terminate()


def _write(folder: Path, dataset, form: Form, size: int | None, shard_mib: float, progress, workers: int) -> None:
    limit, n = shard_bytes(shard_mib), len(dataset)
    index = np.zeros(n, INDEX_DTYPE)
    index["sample_id"] = np.arange(n)
    if form != "tokens":
        index["label"] = dataset.labels
    shard, position, out = 0, 0, open(folder / shard_name(0), "wb")  # noqa: SIM115 - rotated below
    try:
        for i, blob in enumerate(_samples(dataset, form, size, workers)):
            padded = int(align_up(len(blob)))
            if position and position + padded > limit:  # a sample larger than a shard gets one of its own
                out.close()
                shard, position = shard + 1, 0
                out = open(folder / shard_name(shard), "wb")  # noqa: SIM115
            out.write(blob)
            out.write(bytes(padded - len(blob)))
            index[i]["shard"], index[i]["offset"], index[i]["length"] = shard, position, len(blob)
            position += padded
            if progress is not None and ((i + 1) % 256 == 0 or i + 1 == n):
                progress(i + 1, n)
    finally:
        out.close()
    np.savez(folder / "index.npz", index=index, meta=np.array(json.dumps(_meta(dataset, form, size, shard_mib))))


def convert(dataset, form: Form, size: int | None = None, shard_mib: float = DEFAULT_SHARD_MIB,
            progress: Callable[[int, int], None] | None = None, workers: int | None = None) -> Path:
    """Convert `dataset` to raw shards (or reuse the finished conversion); returns the folder."""
    final = raw_path(dataset, form, size, shard_mib)
    if (final / "index.npz").exists():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    except OSError as exc:
        raise DatasetError(f"{final.parent}: cannot write the raw conversion ({exc.strerror or exc})") from None
    try:
        _write(tmp, dataset, form, size, shard_mib, progress, workers or os.cpu_count() or 1)
        open_raw(tmp, dataset, form, size, shard_mib, verify_labels=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "index.npz").exists():  # not a concurrent conversion that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def open_raw(path: str | Path, dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB,
             verify_labels: bool = False) -> RawIndex:
    """Open a raw conversion and check it matches `dataset`, the settings and its shard files."""
    root = Path(path)
    if not (root / "index.npz").exists():
        raise DatasetError(f"{root}: raw shards not found (no index.npz)")
    try:
        with np.load(root / "index.npz", allow_pickle=False) as data:
            index, meta = data["index"], json.loads(str(data["meta"]))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise DatasetError(f"{root / 'index.npz'}: corrupt raw index ({str(exc).splitlines()[0]})") from None
    expected = _meta(dataset, form, size, shard_mib)
    for key, value in expected.items():
        if meta.get(key) != value:
            raise DatasetError(f"{root / 'index.npz'}: {key} is {meta.get(key)!r}, the config needs {value!r}")
    if index.dtype != INDEX_DTYPE or len(index) != len(dataset) or \
            not np.array_equal(index["sample_id"], np.arange(len(dataset))):
        raise DatasetError(f"{root / 'index.npz'}: {len(index)} index rows of {index.dtype}; expected "
                           f"{len(dataset)} rows, sample ids 0..{len(dataset) - 1}")
    shards = [root / shard_name(k) for k in range(int(index["shard"].max()) + 1)]
    ends = index["offset"] + index["length"]
    for k, shard in enumerate(shards):
        try:
            have = shard.stat().st_size
        except FileNotFoundError:
            raise DatasetError(f"{shard}: shard file not found (the index places samples in it)") from None
        rows = np.nonzero((index["shard"] == k) & ((ends > have) | (index["offset"] % ALIGN != 0)))[0]
        if len(rows):
            row = index[rows[0]]
            raise DatasetError(f"{shard}: sample {int(row['sample_id'])} needs bytes {int(row['offset'])}-"
                               f"{int(row['offset'] + row['length'])}, the shard has {have} bytes "
                               f"(truncated shard or bad index)")
    if verify_labels and form != "tokens" and not np.array_equal(index["label"], dataset.labels):
        raise DatasetError(f"{root / 'index.npz'}: labels differ from the source dataset's")
    return RawIndex(root, shards, index, meta)
