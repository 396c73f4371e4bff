"""The Arrow form of a dataset: uncompressed Arrow IPC files (shards of about `shard_mib` MiB, whole record batches
of a fixed row count) and one manifest.

A folder per conversion holds `shard-0000k.arrow`, each shard's entry `shard-0000k.json` (its first sample,
samples, bytes, record batches, the samples it could not convert, the source shards it came from: written last,
so a shard is finished exactly when it is there) and `manifest.json`, written after every shard is read back
against its checksums: the conversion's key (form, source fingerprint, rows, size, rows per record batch), the
source's digest, and the shard table. A folder without it is not a conversion; a shard it lists that is
missing or damaged is one line naming it and its samples. Each record batch carries the CRC-32s of its columns'
chunks and the samples it skipped in its custom metadata. Writing, resuming shard by shard:
`arrow_convert.convert`.

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
- `records`: sample_id, label, record (each record's stored bytes whole; variable-length
  large binary: record sizes spread per file). Record batches hold as many records as fit in
  `RECORD_BATCH_BYTES` (at least one), not `ROWS_PER_BATCH`: 1,024 of MLPerf Storage's 140 MB unet3d samples
  would be one 140 GB batch in memory while writing.

A conversion is keyed by the source's fingerprint and the conversion settings; the source is only ever read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa

from loadopt.errors import DatasetError
from loadopt.files import cache_dir
from loadopt.imaging.frames import FRAME_FIELDS, FrameDims, centre_square, stored_frame
from loadopt.imaging.reencode import REENCODE_QUALITY, bounded_jpeg, restarts_key, source_size, with_restarts
from loadopt.storage.forms import integrity, shard_work
from loadopt.storage.forms.placement import local_dir
from loadopt.storage.forms.shard_work import DEFAULT_SHARD_MIB

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: shards and a manifest (2: chunk checksums, skipped samples in the batches' metadata)
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


def conversion_key(dataset, form: Form, size: int | None, shard_mib: float) -> dict:
    """What a conversion is of: hashed into its folder's name, kept in its manifest and checked when opened."""
    key = {"version": FORMAT_VERSION, "source": dataset.fingerprint, "form": form, "size": size,
           "seq_len": getattr(dataset, "seq_len", None), "rows": len(dataset),
           "rows_per_batch": rows_per_batch(dataset, form), "shard_bytes": shard_bytes(shard_mib)}
    if form == "reencoded":
        key["quality"] = REENCODE_QUALITY
    if form in ("encoded", "reencoded"):
        key["restarts"] = restarts_key()
    return key


def shard_bytes(shard_mib: float) -> int:
    return max(1, int(shard_mib * (1 << 20)))


def arrow_path(dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB) -> Path:
    """The folder of the conversion of `dataset` to `form` in the cache."""
    wanted = json.dumps(conversion_key(dataset, form, size, shard_mib), sort_keys=True)
    key = hashlib.sha256(wanted.encode()).hexdigest()[:16]
    # the cache, or `storage.converted` / beside the source
    return local_dir(dataset, cache_dir()) / "arrow" / f"{dataset.fingerprint}-{form}-{key}"


def shard_name(k: int) -> str:
    return f"{shard_work.shard_stem(k)}.arrow"


def shard_files(path: Path, meta: dict) -> list[Path]:
    """The shard files a conversion's manifest lists."""
    return [path / shard_name(k) for k in range(len(meta["shard_table"]))]


def square_bytes(size: int | None) -> int:
    """Bytes of one `decoded` row: a size x size HWC uint8 square."""
    if size is None:
        raise ValueError("the decoded form is stored at a size: none was given")
    return size * size * 3


def arrow_schema(dataset, form: Form, size: int | None) -> pa.Schema:
    metadata: dict[str, str] = {"loadopt.form": form}  # the source, the rows: the manifest's key
    if form == "tokens":
        width = (dataset.seq_len + 1) * dataset.tokens.itemsize
        metadata.update({"loadopt.seq_len": str(dataset.seq_len), "loadopt.dtype": str(dataset.tokens.dtype)})
        return pa.schema([("sample_id", pa.int64()), ("window", pa.binary(width))], metadata=metadata)
    if form == "records":
        metadata["loadopt.rows_per_batch"] = str(rows_per_batch(dataset, form))
        column = ("record", pa.large_binary())
    elif form == "decoded":
        metadata["loadopt.size"] = str(size)
        column = ("pixels", pa.binary(square_bytes(size)))
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
    `imaging.reencode.with_restarts`), any other image as it is. Its header is read first (`source_size`, no
    pixels decoded): bytes that are no image raise here, so the conversion names the sample (a tar's member) by
    `on_error`, not a bench reading the conversion later."""
    data = _pool_sample(index)
    source_size(data)
    return with_restarts(data)


def reencode_sample(index: int) -> bytes:
    """The `reencoded` form of one sample of the pool's dataset (`imaging.reencode.bounded_jpeg`)."""
    return bounded_jpeg(_pool_sample(index), _POOL_SIZE)


def stored_sizes(dataset, form: Form, size: int | None) -> np.ndarray:
    """Each sample's stored bytes in `form`, about: exact for tokens, records and centre squares; the source file's
    size for the encoded forms; the most a frame can hold for whole frames. The shards are planned by these
    (`plan_shards`) before anything is decoded."""
    n = len(dataset)
    if form == "tokens":
        return np.full(n, (dataset.seq_len + 1) * dataset.tokens.itemsize, np.int64)
    if form in ("decoded", "frames"):
        return np.full(n, (size or 0) ** 2 * 3, np.int64)
    return np.asarray(dataset.sizes, np.int64)


def needed_bytes(dataset, form: Form, size: int | None) -> int:
    """About the bytes of the Arrow form of `dataset` (for the message when the disk is full)."""
    return int(stored_sizes(dataset, form, size).sum())


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


class ShardImages(Protocol):
    """A conversion's shard files as images in memory, everything but the samples' bytes in place, and where those
    are (`ShadowShards`, built from the shards' outlines)."""

    buffers: list[mmap.mmap]

    def read(self, k: int, offset: int, nbytes: int) -> bytes:
        """`nbytes` at `offset` of shard file `k`, from where it is."""
        ...

    def where(self, k: int) -> str:
        """Shard file `k`'s URL, credentials removed."""
        ...


class ArrowConversion(list):
    """The record batches of an opened Arrow conversion, all its shards' in order, with what their metadata says:
    each batch's chunk checksums and first sample, the shard file it is in (`files`, `batch_file`) and where its
    samples' offsets are in that file (`offsets_at`, -1 where not read from a file: `offsets_position`), the
    samples the conversion skipped (index -> reason) and the source's content digest."""

    def __init__(self, path: Path, files: list[Path], batches: list, batch_file: np.ndarray,
                 checksums: list[dict | None], skipped: dict[int, str], source_content: str,
                 images: ShardImages | None = None, offsets_at: np.ndarray | None = None) -> None:
        super().__init__(batches)
        self.path, self.files, self.batch_file, self.checksums = path, files, batch_file, checksums
        self.offsets_at = offsets_at if offsets_at is not None else np.full(len(batches), -1, np.int64)
        self.skipped, self.source_content, self.images = skipped, source_content, images
        self.first_rows = np.cumsum([0] + [b.num_rows for b in batches])[:-1].astype(np.int64)

    def where(self, k: int) -> str:
        """Shard file `k`, as messages name it (its remote URL where its data is remote)."""
        return self.images.where(k) if self.images is not None else str(self.files[k])

    def _chunk(self, b: int, name: str, view: memoryview, at: int) -> bytes | memoryview:
        """Bytes [at, at + a chunk) of a record batch's column region; the samples' from where they are."""
        end = min(at + integrity.CHUNK_BYTES, len(view))
        if self.images is None or name != self[b].schema.names[-1]:
            return view[at:end]
        k = int(self.batch_file[b])
        start = np.frombuffer(view, np.uint8).ctypes.data - np.frombuffer(self.images.buffers[k], np.uint8).ctypes.data
        return self.images.read(k, start + at, end - at)

    def batch_of(self, index: int) -> int:
        """The record batch holding sample `index`."""
        return int(np.searchsorted(self.first_rows, index, side="right")) - 1

    def check(self, verify: integrity.Verify, records: list[int] | None = None) -> None:
        """Check the chunks `verify` asks for (of the given record batches, else of all) against their
        checksums; damage raises `DatasetError` naming the shard, the record batch and the bytes."""
        import zlib

        records = list(range(len(self))) if records is None else records
        chunks = []
        for b in records:
            sums = self.checksums[b]
            if sums is None:
                raise integrity.DamagedConversion(f"{self.where(int(self.batch_file[b]))}: record batch {b} has no "
                                                  "checksums (a damaged or foreign file): "
                                                  f"{integrity.rebuild_hint('arrow')}")
            # A sample draws from the samples' column (where the bytes are); "all" checks every column.
            samples = self[b].schema.names[-1]
            for name, view in _regions(self[b]):
                if verify == "all" or name == samples:
                    chunks += [(b, name, view, k, crc) for k, crc in enumerate(sums.get(name, []))]
        for position in integrity.chunks_to_check(len(chunks), verify if records else "none"):
            b, name, view, k, crc = chunks[position]
            at = k * integrity.CHUNK_BYTES
            if zlib.crc32(self._chunk(b, name, view, at)) != crc:
                first = int(self.first_rows[b])
                raise integrity.damaged(f"{self.where(int(self.batch_file[b]))}: record batch {b} (samples {first}-"
                                        f"{first + self[b].num_rows - 1}), chunk {k} of column {name} (bytes "
                                        f"{at}-{min(at + integrity.CHUNK_BYTES, len(view))})", "arrow")


def mapped_shard(file: Path | str) -> tuple[pa.MemoryMappedFile, int | None]:
    """The shard file memory-mapped, at its start, and the address of its first byte (None for an empty file): a
    buffer's address less it is the buffer's position in the file."""
    source = pa.memory_map(str(file), "r")
    base = source.read_buffer(1).address if source.size() else None  # zero-copy: nothing read
    source.seek(0)
    return source, base


def read_shard(file: Path | str, expected: pa.Schema, samples: str = "",
               image: Any = None) -> list[tuple[pa.RecordBatch, dict]]:
    """The record batches of one shard file, memory-mapped (or read from its `image` in memory, `file` then only
    its name), and each one's custom metadata; its schema checked against `expected`. A missing, truncated or
    foreign file is one line naming it (and `samples`: which)."""
    return read_shard_at(file, expected, samples, image)[0]


def read_shard_at(file: Path | str, expected: pa.Schema, samples: str = "",
                  image: Any = None) -> tuple[list[tuple[pa.RecordBatch, dict]], int | None]:
    """`read_shard`, and the address of the file's first byte in its memory map (`mapped_shard`; None for an
    image)."""
    base = None
    try:
        if image is None:
            source, base = mapped_shard(file)
        reader = pa.ipc.open_file(source if image is None else pa.py_buffer(image))
        pairs = [reader.get_batch_with_custom_metadata(i) for i in range(reader.num_record_batches)]
    except FileNotFoundError:
        raise integrity.DamagedConversion(f"{file}: Arrow shard not found{samples}; "
                                          f"{integrity.rebuild_hint('arrow')}") from None
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise integrity.DamagedConversion(f"{file}: corrupt or truncated Arrow shard{samples}; "
                                          f"{integrity.rebuild_hint('arrow')} ({str(exc).splitlines()[0]})") from None
    if not reader.schema.remove_metadata().equals(expected.remove_metadata()):
        raise DatasetError(f"{file}: schema does not match the config: has {_describe(reader.schema)}, "
                           f"expected {_describe(expected)}")
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    for key, value in (expected.metadata or {}).items():
        if meta.get(key.decode()) != value.decode():
            raise DatasetError(f"{file}: {key.decode()} is {meta.get(key.decode())!r}, the config needs "
                               f"{value.decode()!r}")
    return [(batch, {k.decode(): v.decode() for k, v in (custom or {}).items()}) for batch, custom in pairs], base


def offsets_position(batch: pa.RecordBatch, base: int | None) -> int:
    """Where the samples' offsets (a binary last column's) of `batch` start in its mapped shard file (`base`: the
    file's address, `mapped_shard`); -1 for a fixed-size column or a batch read from an image."""
    column = batch.column(batch.num_columns - 1)
    if base is None or not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
        return -1
    item = 8 if pa.types.is_large_binary(column.type) else 4
    return column.buffers()[1].address + column.offset * item - base


def open_arrow(path: str | Path, dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB,
               verify_labels: bool = False, verify: integrity.Verify = "sample",
               images: ShardImages | None = None) -> ArrowConversion:
    """Open an Arrow conversion (its manifest, then every shard memory-mapped, or from `images` where the shards'
    data is elsewhere) and check it matches `dataset` and the settings, and the chunks that `verify` asks for (a
    random few by default) match their checksums."""
    root = Path(path)
    meta = shard_work.read_manifest(root, "Arrow conversion")
    for key, value in conversion_key(dataset, form, size, shard_mib).items():
        if meta.get(key) != value:
            raise DatasetError(f"{root / shard_work.MANIFEST}: {key} is {meta.get(key)!r}, the config needs {value!r}")
    table, step = meta["shard_table"], rows_per_batch(dataset, form)
    covered = sum(e["samples"] for e in table)
    if covered != len(dataset) or any(e["shard"] != k for k, e in enumerate(table)):
        raise DatasetError(f"{root / shard_work.MANIFEST}: its shards hold {covered} samples; the dataset has "
                           f"{len(dataset)}")
    expected, files = arrow_schema(dataset, form, size), shard_files(root, meta)
    batches, owners, checksums, skipped, offsets_at = [], [], [], {}, []
    for k, (file, entry) in enumerate(zip(files, table, strict=True)):
        which = f" (the manifest lists it: samples {entry['first']}-{entry['first'] + entry['samples'] - 1})"
        name = file if images is None else images.where(k)  # the shard read from its image is named by its URL
        pairs, base = read_shard_at(name, expected, which, None if images is None else images.buffers[k])
        rows = [b.num_rows for b, _ in pairs]
        if sum(rows) != entry["samples"] or any(r != step for r in rows[:-1]) or (rows and rows[-1] > step):
            raise integrity.DamagedConversion(f"{name}: {sum(rows)} rows in record batches of {sorted(set(rows))}; "
                                              f"the manifest says {entry['samples']} in batches of {step}{which}; "
                                              f"{integrity.rebuild_hint('arrow')}")
        for b, (batch, extra) in enumerate(pairs):
            try:
                checksums.append(json.loads(extra["loadopt.checksums"])["regions"])
                skipped.update({int(i): str(why) for i, why in json.loads(extra.get("loadopt.skipped", "[]"))})
            except (KeyError, ValueError, TypeError):
                checksums.append(None)
                if verify != "none":
                    raise integrity.DamagedConversion(f"{name}: record batch {b} has no readable checksums (a damaged "
                                                      f"or foreign file): {integrity.rebuild_hint('arrow')}") from None
            batches.append(batch)
            owners.append(k)
            offsets_at.append(offsets_position(batch, base))
    if verify_labels and form != "tokens":
        labels = np.concatenate([b.column(1).to_numpy() for b in batches])
        if not np.array_equal(labels, dataset.labels):
            raise DatasetError(f"{root}: labels differ from the source dataset's")
    conversion = ArrowConversion(root, files, batches, np.array(owners, np.int64), checksums, skipped,
                                 meta.get("source_content", ""), images, np.array(offsets_at, np.int64))
    conversion.check(verify)
    return conversion


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{field.name}: {field.type}" for field in schema)
