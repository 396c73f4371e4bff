"""The raw shard form of a dataset: samples packed into large flat files, each at a 4 KiB boundary.

A folder per conversion holds `shard-00000.bin`, ... (about `shard_mib` MiB each) and `index.npz`:
a structured array (sample_id, shard, offset, length, label) and the conversion's metadata as JSON
(form, source fingerprint, rows, decoded size and HWC shape, token dtype and window length).
Every sample starts at a multiple of 4096 and every shard is padded to one, so a reader can fetch
any run of samples with O_DIRECT (aligned offset, length and buffer) or cuFile without a bounce.

Forms: `encoded` (the stored JPEG bytes), `reencoded` (the Arrow `reencoded` form's bytes: a JPEG over
`size` = `pipeline.max_side` re-encoded at <= size, the others as stored), `decoded` (uint8 HWC pixels,
the very bytes of the Arrow decoded form: same decode function), `frames` (whole frames, longer side
at most `size`, the Arrow `frames` form's bytes; their dims in `index.npz` as `frames`: int32 (height,
width, source height, source width) per sample, the samples at variable lengths), `tokens` (windows of
seq_len + 1 token ids), `records` (each record's stored bytes whole, as storage/records.py reads it: a
raw record's byte range, an npz file's record row; the loader delivers their first `delivered_bytes`).
Conversion rules are the Arrow form's: keyed by source fingerprint and settings, written in a
temporary folder, verified, renamed; an interrupted conversion is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import overload

import numpy as np
from typing_extensions import NotRequired, TypedDict

from loadopt.errors import DatasetError
from loadopt.files import cache_dir, is_no_space
from loadopt.imaging.reencode import REENCODE_QUALITY, restarts_key
from loadopt.storage import arrow_format, decode_pool, integrity
from loadopt.storage.arrow_format import Form
from loadopt.storage.tier_reads import local_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: chunk checksums of each shard, skipped samples and the source's digest in the meta
ALIGN = 4096
DEFAULT_SHARD_MIB = 256.0
INDEX_DTYPE = np.dtype([("sample_id", "<i8"), ("shard", "<i4"), ("offset", "<i8"), ("length", "<i8"),
                        ("label", "<i8")])


class RawKey(TypedDict):
    """What a conversion is of (hashed into its folder's name, checked when it is opened)."""

    version: int
    form: Form
    source: str  # the dataset's fingerprint
    rows: int
    shard_bytes: int
    size: int | None
    shape: list[int | None] | None  # of a decoded image (the size) or a token window
    dtype: str
    seq_len: int | None
    jpeg_quality: NotRequired[int]  # reencoded
    jpeg_restarts: NotRequired[int | None]  # encoded, reencoded: restarts_key()


class ShardChecksums(TypedDict):
    algorithm: str
    chunk_bytes: int
    shards: list[list[int]]  # per shard, the CRC of each chunk


class RawMeta(RawKey):
    """A finished conversion's metadata: index.npz's `meta`."""

    source_content: str  # the source's digest when the conversion was made ("" where not read)
    skipped: list[list[int | str]]  # [sample index, reason] of each sample that could not be read
    checksums: ShardChecksums


@overload
def align_up(n: int) -> int: ...
@overload
def align_up(n: np.ndarray) -> np.ndarray: ...
def align_up(n: np.ndarray | int) -> np.ndarray | int:
    """`n` rounded up to the next multiple of 4096."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def shard_bytes(shard_mib: float) -> int:
    return max(ALIGN, int(align_up(int(shard_mib * (1 << 20)))))


def _meta(dataset, form: Form, size: int | None, shard_mib: float) -> RawKey:
    meta = RawKey(version=FORMAT_VERSION, form=form, source=dataset.fingerprint, rows=len(dataset),
                  shard_bytes=shard_bytes(shard_mib), size=size, shape=None, dtype="uint8", seq_len=None)
    if form == "decoded":
        meta["shape"] = [size, size, 3]
    if form == "reencoded":
        meta["jpeg_quality"] = REENCODE_QUALITY
    if form in ("encoded", "reencoded"):
        meta["jpeg_restarts"] = restarts_key()
    if form == "tokens":
        meta["seq_len"], meta["shape"] = dataset.seq_len, [dataset.seq_len + 1]
        meta["dtype"] = str(dataset.tokens.dtype)
    return meta


def raw_path(dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB) -> Path:
    """The folder of the conversion of `dataset` to `form` in the cache."""
    key = hashlib.sha256(json.dumps(_meta(dataset, form, size, shard_mib), sort_keys=True).encode()).hexdigest()[:16]
    # the cache, or `storage.converted` / beside the source (storage/tier_reads.py)
    return local_dir(dataset, cache_dir()) / "raw" / f"{dataset.fingerprint}-{form}-{key}"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


@dataclass
class RawIndex:
    """An opened conversion: its shard files and one index row per sample."""

    root: Path
    shards: list[Path]
    index: np.ndarray  # INDEX_DTYPE, row i = sample i
    meta: RawMeta
    frames: np.ndarray | None = None  # the `frames` form: (n, 4) int32 height, width, source height, width

    def __post_init__(self) -> None:
        self.shard: np.ndarray = self.index["shard"].astype(np.int64)
        self.offset: np.ndarray = self.index["offset"]
        self.length: np.ndarray = self.index["length"]

    def frames_of(self, indices: np.ndarray) -> np.ndarray:
        """The `frames` form's (height, width, source height, source width) rows of these samples."""
        if self.frames is None:
            raise ValueError(f"{self.root}: not the frames form (no frame dims)")
        return self.frames[indices]


def _samples(dataset, form: Form, size: int | None, workers: int, dims: list, on_error: str = "raise",
             skipped: list | None = None) -> Iterator[bytes]:
    """Each sample's bytes in order; one that cannot be decoded goes by `on_error` (`skip`: a blank one,
    `[index, reason]` appended to `skipped`)."""
    n = len(dataset)
    skipped = [] if skipped is None else skipped
    if form == "frames":  # the Arrow frames form's own function; each frame's dims appended to `dims`
        arrow_format.set_pool_dataset(dataset, size)
        pool = decode_pool.start(workers)
        decode = partial(integrity.guarded, arrow_format.decode_frame)
        try:
            for i, result in enumerate(pool.imap(decode, range(n), chunksize=16) if pool else map(decode, range(n))):
                blob, frame = integrity.keep_or_skip(dataset, [i], [result], on_error, skipped,
                                                     lambda: (bytes(3), (1, 1, 1, 1)))[0]
                dims.append(frame)
                yield blob
        finally:
            decode_pool.stop(pool)
    elif form == "tokens":
        windows = dataset.windows()
        for i in range(n):
            yield windows[i].tobytes()
    elif form == "encoded":  # the Arrow encoded form's own function: the same bytes in both forms
        arrow_format.set_pool_dataset(dataset, size)
        pool = decode_pool.start(workers)
        try:
            yield from (pool.imap(arrow_format.encode_sample, range(n), chunksize=16) if pool else
                        map(arrow_format.encode_sample, range(n)))
        finally:
            decode_pool.stop(pool)
    elif form == "records":
        for i in range(n):
            yield dataset.read(i)
    elif form == "reencoded":  # the Arrow reencoded form's own function: the same bytes in both forms
        if not size:
            raise ValueError("the reencoded form is bounded by a max side: none was given")
        arrow_format.set_pool_dataset(dataset, size)
        encode = partial(integrity.guarded, arrow_format.reencode_sample)
        pool = decode_pool.start(workers)
        try:
            for i, result in enumerate(pool.imap(encode, range(n), chunksize=4) if pool else map(encode, range(n))):
                yield integrity.keep_or_skip(dataset, [i], [result], on_error, skipped, bytes)[0]
        finally:
            decode_pool.stop(pool)
    else:  # the Arrow decoded form's own decode function: bit-equal pixels in both forms
        assert size is not None  # the decoded form is stored at a size
        arrow_format.set_pool_dataset(dataset, size)
        decode = partial(integrity.guarded, arrow_format.decode_centre)
        pool = decode_pool.start(workers)
        try:
            for i, result in enumerate(pool.imap(decode, range(n), chunksize=16) if pool else map(decode, range(n))):
                yield integrity.keep_or_skip(dataset, [i], [result], on_error, skipped,
                                             lambda: bytes(size * size * 3))[0]
        finally:
            decode_pool.stop(pool)


def _write(folder: Path, dataset, form: Form, size: int | None, shard_mib: float, progress, workers: int,
           on_error: str = "raise", digest: str = "") -> None:
    limit, n = shard_bytes(shard_mib), len(dataset)
    sums = [integrity.ChunkSums()]
    skipped: list[list[int | str]] = []
    index = np.zeros(n, INDEX_DTYPE)
    index["sample_id"] = np.arange(n)
    if form != "tokens":
        index["label"] = dataset.labels
    shard, position, out = 0, 0, open(folder / shard_name(0), "wb")  # noqa: SIM115 - rotated below
    try:
        dims: list = []
        for i, blob in enumerate(_samples(dataset, form, size, workers, dims, on_error, skipped)):
            padded = int(align_up(len(blob)))
            if position and position + padded > limit:  # a sample larger than a shard gets one of its own
                out.close()
                shard, position = shard + 1, 0
                out = open(folder / shard_name(shard), "wb")  # noqa: SIM115
                sums.append(integrity.ChunkSums())
            for piece in (blob, bytes(padded - len(blob))):
                out.write(piece)
                sums[-1].update(piece)
            index[i]["shard"], index[i]["offset"], index[i]["length"] = shard, position, len(blob)
            position += padded
            if progress is not None and ((i + 1) % 256 == 0 or i + 1 == n):
                progress(i + 1, n)
    finally:
        out.close()
    meta: RawMeta = {**_meta(dataset, form, size, shard_mib), "source_content": digest, "skipped": skipped,
                     "checksums": {"algorithm": integrity.ALGORITHM, "chunk_bytes": integrity.CHUNK_BYTES,
                                   "shards": [s.finish() for s in sums]}}
    if form == "frames":  # with each frame's dims
        np.savez(folder / "index.npz", index=index, meta=np.array(json.dumps(meta)),
                 frames=np.array(dims, np.int32).reshape(n, 4))
    else:
        np.savez(folder / "index.npz", index=index, meta=np.array(json.dumps(meta)))


def convert(dataset, form: Form, size: int | None = None, shard_mib: float = DEFAULT_SHARD_MIB,
            progress: Callable[[int, int], None] | None = None, workers: int | None = None, *,
            on_error: str = "raise", force: bool = False, verify: bool = False) -> Path:
    """Convert `dataset` to raw shards (or reuse the finished conversion); returns the folder.

    `on_error`, `force` and `verify` as for `arrow_format.convert`."""
    final = raw_path(dataset, form, size, shard_mib)
    integrity.remove_dead_temps(final.parent)  # what a killed conversion left, whatever this one does
    if (final / "index.npz").exists() and not force and not verify:
        return final
    # The source's content, recorded with the conversion: read once more, so only where that is cheap
    # (a local disk) or asked for (--verify).
    # (records: their fingerprint has each file's name, size and mtime; a sample is not a stored blob)
    digest = integrity.source_digest(dataset) if form not in ("tokens", "records") and \
        (verify or dataset.is_local()) else ""
    if (final / "index.npz").exists() and not force:
        if open_raw(final, dataset, form, size, shard_mib, verify="all").meta.get("source_content") == digest:
            return final
        log.warning("%s: the source's content differs from the converted one's: converting again", final)
    needed = int(arrow_format.needed_bytes(dataset, form, size) * 1.05)  # + the 4 KiB alignment, about
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = integrity.temp_path(final)
        tmp.mkdir()
    except OSError as exc:
        if is_no_space(exc):
            raise integrity.no_space_error(final.parent, needed, f"the raw conversion ({form})",
                                           form == "frames") from None
        raise DatasetError(f"{final.parent}: cannot write the raw conversion ({exc.strerror or exc}); "
                           "set storage.converted to a writable folder") from None
    try:
        _write(tmp, dataset, form, size, shard_mib, progress, workers or os.cpu_count() or 1, on_error, digest)
        open_raw(tmp, dataset, form, size, shard_mib, verify_labels=True, verify="none")
        if force and final.exists():  # the old conversion goes only once the new one is complete
            old = final.with_name(f".{final.name}.{os.getpid()}.old.tmp")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "index.npz").exists():  # not a concurrent conversion that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(exc):
            raise integrity.no_space_error(final.parent, needed, f"the raw conversion ({form})",
                                           form == "frames") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def open_raw(path: str | Path, dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB,
             verify_labels: bool = False, verify: integrity.Verify = "sample") -> RawIndex:
    """Open a raw conversion and check it matches `dataset`, the settings and its shard files, and that
    the chunks `verify` asks for (a random few by default) match their checksums."""
    root = Path(path)
    if not (root / "index.npz").exists():
        raise DatasetError(f"{root}: raw shards not found (no index.npz)")
    try:
        with np.load(root / "index.npz", allow_pickle=False) as data:
            index, meta = data["index"], json.loads(str(data["meta"]))
            frames = data["frames"] if "frames" in data.files else None
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
    if form == "frames" and (frames is None or frames.shape != (len(index), 4) or (frames <= 0).any()
                             or not np.array_equal(index["length"], frames[:, 0].astype(np.int64) * frames[:, 1] * 3)):
        raise DatasetError(f"{root / 'index.npz'}: whole-frame dims missing or invalid (expected {len(index)} rows "
                           f"of height, width, source height, source width)")
    check_shards(root, shards, meta, verify, index)
    return RawIndex(root, shards, index, meta, frames)


def check_shards(root: Path, shards: list[Path], meta: dict, verify: integrity.Verify, index: np.ndarray) -> None:
    """Check the shard chunks `verify` asks for against the checksums in the index; damage raises
    `DatasetError` naming the shard, the chunk and the samples in it."""
    sums = (meta.get("checksums") or {}).get("shards")
    if verify == "none":
        return
    if not isinstance(sums, list) or len(sums) != len(shards):
        raise DatasetError(f"{root / 'index.npz'}: no checksums for the shards (a damaged or foreign index): "
                           "rebuild it with `loadopt convert CONFIG --to raw --force ...`")
    chunks = [(k, c) for k, shard_sums in enumerate(sums) for c in range(len(shard_sums))]
    for k, c in (chunks[i] for i in integrity.chunks_to_check(len(chunks), verify)):
        for _, data in integrity.iter_file_chunks(shards[k], [c]):
            if zlib.crc32(data) != sums[k][c]:
                at, end = c * integrity.CHUNK_BYTES, c * integrity.CHUNK_BYTES + len(data)
                inside = index["sample_id"][(index["shard"] == k) & (index["offset"] < end) &
                                            (index["offset"] + index["length"] > at)]
                samples = f", samples {inside.min()}-{inside.max()}" if len(inside) else ""
                raise integrity.damaged(f"{shards[k]}: chunk {c} (bytes {at}-{end}{samples})")
