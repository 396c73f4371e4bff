"""The raw shard form of a dataset: samples packed into large flat files, each at a 4 KiB boundary.

A folder per conversion holds shards and one manifest. Shard k is `shard-0000k.bin` (about `shard_mib` MiB),
its index `shard-0000k.idx.npy` (one row per sample it holds: sample_id, shard, offset, length, label), for the
`frames` form its frames' dims `shard-0000k.frames.npy`, and `shard-0000k.json` (its first sample, sample count,
bytes, chunk checksums, the samples it could not convert and the source shards it came from: written last, so
a shard is finished exactly when it is there). `manifest.json`, written after every shard is verified, holds
the conversion's key (form, source fingerprint, rows, decoded size and HWC shape, token dtype and window
length), the source's digest, the samples skipped, the shard table (first sample, samples, bytes, checksums,
source shards of each) and `files`, the CRC-32 of each index and frame dims file: a folder without it is not a
conversion, and a shard or file it names that is missing, short or damaged is one line
(`integrity.DamagedConversion`, the command that rebuilds it named), never a silently short dataset.

A reader opens the manifest and maps a shard's index when it first reads a sample of that shard
(`RawIndex.locate`), reading only the rows it locates: under the window shuffle a rank reads runs of its own
shards, so its resident index is their rows and the shard table, not the dataset's index.

Every sample starts at a multiple of 4096 and every shard is padded to one, so a reader can fetch any run of
samples with O_DIRECT (aligned offset, length and buffer) or cuFile without a bounce.

Forms: `encoded` (the stored JPEG bytes), `reencoded` (the Arrow `reencoded` form's bytes: a JPEG over
`size` = `pipeline.max_side` re-encoded at <= size, the others as stored), `decoded` (uint8 HWC pixels,
the very bytes of the Arrow decoded form: same decode function), `frames` (whole frames, longer side
at most `size`, the Arrow `frames` form's bytes; their dims (height, width, source height, source width) per
sample, the samples at variable lengths), `tokens` (windows of seq_len + 1 token ids), `records` (each
record's stored bytes whole, as the records source reads it: a raw record's byte range, an npz file's record
row; the loader delivers their first `delivered_bytes`). Writing, and resuming a conversion shard by shard:
`raw_convert.convert`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, overload

import numpy as np
from typing_extensions import NotRequired, TypedDict

from loadopt.errors import DatasetError
from loadopt.files import cache_dir
from loadopt.imaging.reencode import REENCODE_QUALITY, restarts_key
from loadopt.storage.forms import integrity, shard_work
from loadopt.storage.forms.arrow_format import Form
from loadopt.storage.forms.placement import local_dir

if TYPE_CHECKING:
    from loadopt.storage.remote.converted import RemoteShards

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: a manifest and an index per shard (2: chunk checksums, skipped samples, source digest)
ALIGN = 4096
DEFAULT_SHARD_MIB = shard_work.DEFAULT_SHARD_MIB
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
    """How the shard table's `checksums` were taken."""

    algorithm: str
    chunk_bytes: int


class ShardEntry(TypedDict):
    """One finished shard: `shard-0000k.json`, and its row of the manifest's shard table."""

    shard: int
    first: int  # its first sample
    samples: int
    bytes: int  # the .bin file's size
    checksums: list[int]  # CRC-32 of each chunk of the .bin file
    skipped: list[list[int | str]]  # [sample index, reason] of its samples that could not be read
    source_shards: list[int]  # the first and last source shard its samples came from
    max_length: int  # its longest sample
    kept_from: NotRequired[str]  # the earlier conversion it was taken from (its source shards unchanged)


class RawMeta(RawKey):
    """A finished conversion's metadata: `manifest.json`."""

    source_content: str  # the source's digest when the conversion was made ("" where not read)
    skipped: list[list[int | str]]  # [sample index, reason] of each sample that could not be read
    checksums: ShardChecksums
    shard_table: list[ShardEntry]
    lineage: NotRequired[str]  # the same for the conversions of one source before and after a shard of it changed
    source_table: NotRequired[list[list] | None]  # [key, first sample, samples] per source shard (`source_table`)
    files: NotRequired[dict[str, int]]  # CRC-32 of each index (and frame dims) file, by name


@overload
def align_up(n: int) -> int: ...
@overload
def align_up(n: np.ndarray) -> np.ndarray: ...
def align_up(n: np.ndarray | int) -> np.ndarray | int:
    """`n` rounded up to the next multiple of 4096."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def shard_bytes(shard_mib: float) -> int:
    return max(ALIGN, int(align_up(int(shard_mib * (1 << 20)))))


def conversion_key(dataset, form: Form, size: int | None, shard_mib: float) -> RawKey:
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
    wanted = json.dumps(conversion_key(dataset, form, size, shard_mib), sort_keys=True)
    key = hashlib.sha256(wanted.encode()).hexdigest()[:16]
    # the cache, or `storage.converted` / beside the source
    return local_dir(dataset, cache_dir()) / "raw" / f"{dataset.fingerprint}-{form}-{key}"


_PAGE = 4096
MANIFEST = shard_work.MANIFEST


def shard_name(k: int) -> str:
    return f"{shard_work.shard_stem(k)}.bin"


def shard_index_name(k: int) -> str:
    return f"{shard_work.shard_stem(k)}.idx.npy"


def shard_frames_name(k: int) -> str:
    return f"{shard_work.shard_stem(k)}.frames.npy"


@dataclass
class RawIndex:
    """An opened conversion: its shard files, the manifest and each shard's index rows, mapped when a sample of
    the shard is first located (`locate`); `index`, `shard`, `offset`, `length` and `frames` read every row
    (for checks and tools, not the loaders' per-batch path)."""

    root: Path
    shards: list[Path]
    meta: RawMeta
    firsts: np.ndarray = field(init=False)  # int64: each shard's first sample, and the sample count at the end
    max_length: int = field(init=False)  # the longest sample's bytes
    _rows: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _frames: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _pages: dict[int, np.ndarray] = field(default_factory=dict, repr=False)  # per shard: its index pages read

    def __post_init__(self) -> None:
        table = self.meta["shard_table"]
        self.firsts = np.array([e["first"] for e in table] + [self.meta["rows"]], dtype=np.int64)
        self.max_length = max((e["max_length"] for e in table), default=0)

    def _shard_rows(self, k: int) -> np.ndarray:
        rows = self._rows.get(k)
        if rows is None:
            rows = self._rows[k] = load_shard_index(self.root, k, self.meta["shard_table"][k])
        return rows

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, offset, length) of each sample, int64. The rows read are checked (their sample ids, and that
        each sample lies inside its shard at a 4 KiB boundary): a damaged index is one line naming the file."""
        indices = np.asarray(indices, dtype=np.int64)
        owner = np.searchsorted(self.firsts, indices, side="right") - 1
        rows = np.empty(len(indices), INDEX_DTYPE)
        table = self.meta["shard_table"]
        for k in np.unique(owner).tolist():
            mine = owner == k
            mapped = self._shard_rows(k)
            at = indices[mine] - self.firsts[k]
            got = rows[mine] = mapped[at]
            header = _header_bytes(mapped)
            touched = self._pages.setdefault(k, np.zeros(-(-(header + mapped.nbytes) // _PAGE), bool))
            touched[(header + at * INDEX_DTYPE.itemsize) // _PAGE] = True
            bad = np.nonzero((got["sample_id"] != indices[mine]) | (got["shard"] != k) |
                             (got["offset"] % ALIGN != 0) | (got["offset"] + got["length"] > table[k]["bytes"]))[0]
            if len(bad):
                row = got[bad[0]]
                raise integrity.DamagedConversion(
                    f"{self.shards[k]}: sample {int(indices[mine][bad[0]])} needs bytes {int(row['offset'])}-"
                    f"{int(row['offset'] + row['length'])} (index row of sample {int(row['sample_id'])}), the shard "
                    f"has {table[k]['bytes']} bytes (truncated shard or bad index; {integrity.rebuild_hint('raw')})")
        return rows["shard"].astype(np.int64), np.ascontiguousarray(rows["offset"]), \
            np.ascontiguousarray(rows["length"])

    def frames_of(self, indices: np.ndarray) -> np.ndarray:
        """The `frames` form's (height, width, source height, source width) rows of these samples."""
        if self.meta["form"] != "frames":
            raise ValueError(f"{self.root}: not the frames form (no frame dims)")
        indices = np.asarray(indices, dtype=np.int64)
        owner = np.searchsorted(self.firsts, indices, side="right") - 1
        out = np.empty((len(indices), 4), np.int32)
        for k in np.unique(owner).tolist():
            if k not in self._frames:
                self._frames[k] = load_shard_frames(self.root, k, self.meta["shard_table"][k])
            mine = owner == k
            out[mine] = self._frames[k][indices[mine] - self.firsts[k]]
        return out

    def opened_shards(self) -> list[int]:
        """The shards whose index this reader has mapped (it reads the pages of the rows it locates only)."""
        return sorted(self._rows)

    def index_bytes_read(self) -> int:
        """The index this reader has needed: the 4 KiB pages of index files holding the rows it located, and the
        shard table (what a rank of a web-scale dataset holds, against `index_bytes`)."""
        return sum(int(p.sum()) for p in self._pages.values()) * _PAGE + self.firsts.nbytes

    def index_bytes(self) -> int:
        """The whole conversion's index files on disk."""
        return sum((self.root / shard_index_name(k)).stat().st_size for k in range(len(self.shards)))

    # -- the whole index (checks and tools) -------------------------------------------------------

    @property
    def index(self) -> np.ndarray:
        """Every sample's row (INDEX_DTYPE, row i = sample i): loads every shard's index."""
        if not len(self.shards):
            return np.zeros(0, INDEX_DTYPE)
        everything = np.arange(self.meta["rows"])
        self.locate(everything)  # every row checked
        return np.concatenate([np.asarray(self._shard_rows(k)) for k in range(len(self.shards))])

    @property
    def shard(self) -> np.ndarray:
        return self.index["shard"].astype(np.int64)

    @property
    def offset(self) -> np.ndarray:
        return self.index["offset"]

    @property
    def length(self) -> np.ndarray:
        return self.index["length"]

    @property
    def frames(self) -> np.ndarray | None:
        """The `frames` form's dims of every sample ((n, 4) int32), else None."""
        if self.meta["form"] != "frames":
            return None
        return self.frames_of(np.arange(self.meta["rows"]))


def load_shard_index(root: Path, k: int, entry: ShardEntry) -> np.ndarray:
    """Shard k's index rows, memory-mapped: a reader's resident index is the pages of the rows it reads (under the
    window shuffle, its own shards' runs), not the shard's. Its size is checked against the manifest entry here,
    each row read by `RawIndex.locate`."""
    path = root / shard_index_name(k)
    try:
        rows = _map_rows(path)
    except FileNotFoundError:
        raise integrity.DamagedConversion(f"{path}: shard index not found (the manifest lists shard {k}); the "
                                          f"conversion is damaged: {integrity.rebuild_hint('raw')}") from None
    except (OSError, ValueError, EOFError) as exc:
        raise integrity.DamagedConversion(f"{path}: corrupt raw index ({str(exc).splitlines()[0]}; "
                                          f"{integrity.rebuild_hint('raw')})") from None
    if rows.dtype != INDEX_DTYPE or rows.shape != (entry["samples"],):
        raise integrity.DamagedConversion(
            f"{path}: {len(rows)} index rows of {rows.dtype}; the manifest says samples {entry['first']}-"
            f"{entry['first'] + entry['samples'] - 1} (a damaged or foreign index; {integrity.rebuild_hint('raw')})")
    return rows


def _header_bytes(rows: np.ndarray) -> int:
    """Where the rows start in their file (the .npy header before them): the base mapping's length less theirs."""
    base = rows.base
    return len(base) - rows.nbytes if isinstance(base, mmap.mmap) else 0


def _map_rows(path: Path) -> np.ndarray:
    """The rows of a shard index file as a read-only memory map, read-ahead off: the rows a rank reads are runs of
    its own shards, and read-ahead (128 KiB at a time) would pull the neighbouring ranks' rows in too."""
    with open(path, "rb") as handle:
        version = np.lib.format.read_magic(handle)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(handle)
        start = handle.tell()
        if fortran or len(shape) != 1:
            raise ValueError(f"not a 1-d index array (shape {shape})")
        if shape[0] == 0:
            return np.zeros(0, dtype)
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype, count=shape[0], offset=start)


def load_shard_frames(root: Path, k: int, entry: ShardEntry) -> np.ndarray:
    path = root / shard_frames_name(k)
    try:
        frames = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise integrity.DamagedConversion(f"{path}: whole-frame dims missing or invalid ({str(exc).splitlines()[0]}; "
                                          f"{integrity.rebuild_hint('raw')})") from None
    if frames.shape != (entry["samples"], 4) or (frames <= 0).any():
        raise integrity.DamagedConversion(f"{path}: whole-frame dims missing or invalid (expected {entry['samples']} "
                                          "rows of height, width, source height, source width; "
                                          f"{integrity.rebuild_hint('raw')})")
    return frames


def read_manifest(root: Path) -> RawMeta:
    """The conversion's manifest; one line naming the folder when it is missing or unreadable."""
    return shard_work.read_manifest(root, "raw shards")  # type: ignore[return-value]  # checked by open_raw


def open_raw(path: str | Path, dataset, form: Form, size: int | None, shard_mib: float = DEFAULT_SHARD_MIB,
             verify_labels: bool = False, verify: integrity.Verify = "sample",
             data: RemoteShards | None = None) -> RawIndex:
    """Open a raw conversion and check it matches `dataset`, the settings and its shard files (each one there
    at the size the manifest says), and that the chunks `verify` asks for (a random few by default) match their
    checksums. `verify_labels` (after a conversion) loads every shard's index and checks the labels too. `data`:
    where the shard files are when `path` holds the conversion's reference only."""
    root = Path(path)
    meta = read_manifest(root)
    expected = conversion_key(dataset, form, size, shard_mib)
    for key, value in expected.items():
        if meta.get(key) != value:
            raise DatasetError(f"{root / MANIFEST}: {key} is {meta.get(key)!r}, the config needs {value!r}")
    table = meta["shard_table"]
    covered = sum(e["samples"] for e in table)
    if covered != len(dataset) or any(e["shard"] != k for k, e in enumerate(table)):
        raise DatasetError(f"{root / MANIFEST}: its shards hold {covered} samples; the dataset has {len(dataset)}")
    shards = [root / shard_name(k) for k in range(len(table))]
    remote_sizes = data.sizes() if data is not None else {}
    for shard, entry in zip(shards, table, strict=True):
        where = data.where(shard.name) if data is not None else str(shard)
        try:
            have = remote_sizes[shard.name] if data is not None else shard.stat().st_size
        except (FileNotFoundError, KeyError):
            raise integrity.DamagedConversion(f"{where}: shard file not found (the manifest lists it, samples "
                                              f"{entry['first']}-{entry['first'] + entry['samples'] - 1}); "
                                              f"{integrity.rebuild_hint('raw')}") from None
        if have < entry["bytes"]:
            raise integrity.DamagedConversion(f"{where}: {have} bytes, the manifest says {entry['bytes']} (truncated "
                                              f"shard; {integrity.rebuild_hint('raw')})")
    raw = RawIndex(root, shards, meta)
    check_shards(root, shards, meta, verify, raw, data)  # first: a damaged index is named by its checksum
    if verify_labels:
        index = raw.index
        if form != "tokens" and not np.array_equal(index["label"], dataset.labels):
            raise DatasetError(f"{root / MANIFEST}: labels differ from the source dataset's")
        if form == "frames":
            frames = raw.frames
            assert frames is not None
            if not np.array_equal(index["length"], frames[:, 0].astype(np.int64) * frames[:, 1] * 3):
                raise DatasetError(f"{root / MANIFEST}: whole-frame dims do not match the samples' lengths")
    return raw


def check_shards(root: Path, shards: list[Path], meta: RawMeta, verify: integrity.Verify, raw: RawIndex,
                 data: RemoteShards | None = None) -> None:
    """Check the shard chunks `verify` asks for (read from `data` when the shards are there) against the
    manifest's checksums, and the index (and frame dims) files of the shards they are in (of every shard:
    `all`) against theirs, those first (a damaged index would misname the samples of a damaged chunk); damage
    raises `integrity.DamagedConversion` naming the file (a shard's: the chunk and the samples in it)."""
    if verify == "none":
        return
    sums = [entry.get("checksums") for entry in meta["shard_table"]]
    if len(sums) != len(shards) or not all(isinstance(s, list) and s for s in sums):
        raise integrity.DamagedConversion(f"{root / MANIFEST}: no checksums for the shards (a damaged or foreign "
                                          f"manifest): {integrity.rebuild_hint('raw')}")
    chunks = [(k, c) for k, shard_sums in enumerate(sums) for c in range(len(shard_sums))]
    picked = [chunks[i] for i in integrity.chunks_to_check(len(chunks), verify)]
    files = meta.get("files") or {}
    mine = tuple(f"{shard_work.shard_stem(k)}." for k in {k for k, _ in picked})
    integrity.check_files(root, files, [name for name in files if verify == "all" or name.startswith(mine)], "raw")
    for k, c in picked:
        read = data.chunks(shards[k].name, [c]) if data is not None else integrity.iter_file_chunks(shards[k], [c])
        for _, chunk in read:
            if zlib.crc32(chunk) != sums[k][c]:
                at, end = c * integrity.CHUNK_BYTES, c * integrity.CHUNK_BYTES + len(chunk)
                rows = raw._shard_rows(k)
                inside = rows["sample_id"][(rows["offset"] < end) & (rows["offset"] + rows["length"] > at)]
                samples = f", samples {inside.min()}-{inside.max()}" if len(inside) else ""
                where = data.where(shards[k].name) if data is not None else shards[k]
                raise integrity.damaged(f"{where}: chunk {c} (bytes {at}-{end}{samples})", "raw")
