"""ImageFolder datasets (`<root>/<split>/<class>/<image>`) on any fsspec filesystem.

The listing is done once, in the consumer process, and kept in numpy arrays (no per-sample Python
objects: forked workers would otherwise touch every refcount and copy the pages). A real dataset is
only ever read; the synthetic one is generated into the cache on first use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import fsspec
import numpy as np

from loadopt.config_models import Config
from loadopt.errors import ConfigError, DatasetError
from loadopt.files import cache_dir, is_no_space
from loadopt.storage import manifest
from loadopt.storage.records import RecordDataset
from loadopt.storage.remote import is_local_fs, open_url, redact, storage_errors, why_missing
from loadopt.storage.tier_reads import conversion_home
from loadopt.storage.tiers import dataset_root, resolve_tier, tier_filesystem

if TYPE_CHECKING:  # they import this module's helpers
    from loadopt.storage.parquet_source import ParquetDataset
    from loadopt.storage.webdataset_source import WebDataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


@dataclass
class ImageDataset:
    """The samples of one split: where they are, their labels and stored sizes."""

    root: str  # the split folder, as a path or URL
    fs: fsspec.AbstractFileSystem
    paths: np.ndarray  # fixed-width UTF-8 bytes, one per sample, as `fs` names them
    labels: np.ndarray  # int64
    sizes: np.ndarray  # int64, stored (encoded) bytes
    classes: list[str]
    fingerprint: str
    synthetic: bool = False
    converted: str | None = None  # where its conversions live when not in the cache (storage/tier_reads.py)
    left_out: list[str] = field(default_factory=list)  # samples indexing left out (on_error: skip), named
    kind: ClassVar[str] = "images"  # what `recipe` and the backends' `supports` tell datasets apart by
    source_format: ClassVar[str] = "imagefolder"

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return self.paths[index].decode()

    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def read(self, index: int) -> bytes:
        """The stored bytes of sample `index` (plain `open` on local disks: no fsspec overhead)."""
        if self.is_local():
            with open(self.paths[index], "rb") as handle:
                return handle.read()
        return self.fs.cat_file(self.path(index))

    # DataLoader-era code reads these off `loader.dataset` (torchvision's ImageFolder has the same names).
    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.classes)}

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    @property
    def samples(self) -> list[tuple[str, int]]:
        return [(self.path(i), int(self.labels[i])) for i in range(len(self))]

    def local_files(self) -> list[str]:
        """Every sample file when the dataset is read straight from a local disk, else empty (also under an
        emulated tier: whoever reads these files directly would bypass the tier's limits)."""
        return [p.decode() for p in self.paths] if self.is_local() else []


def scan_image_folder(root_url: str, split: str = "train",
                      storage_options: dict[str, Any] | None = None, relist: bool = False) -> ImageDataset:
    """List `<root>/<split>/<class>/*`; when `<root>/<split>` is absent, `root` is taken as the split.

    `root_url` is a path or any fsspec URL (`s3://`, `http(s)://`, `memory://`, ...), opened with
    `storage_options`; messages show it with its credentials redacted. A local folder's listing is kept
    in the cache and reused while its folders' mtimes are unchanged (storage/manifest.py says what that
    misses); `relist` lists it again regardless."""
    fs, root = open_url(root_url, storage_options)
    url, root_url = root_url, redact(root_url)
    with storage_errors(url, "list the dataset"):
        if not fs.exists(root):  # remote drivers say False for a host that refused too: ask why
            raise DatasetError(f"{root_url}: {why_missing(fs, root, url, 'dataset folder not found')}")
        split_root = root.rstrip("/") + "/" + split
        if fs.isdir(split_root):
            root = split_root
        elif split != "train" and fs.isdir(root):  # only train may be the root itself (a bare class tree)
            splits = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.isdir(p))
            raise DatasetError(f"{root_url}: no split folder {split!r} (expected <root>/{split}/<class>/; folders "
                               f"there: {', '.join(splits) or 'none'})")
        elif not fs.isdir(root):
            raise DatasetError(f"{root_url}: is not a folder (expected an ImageFolder tree <root>/{split}/<class>/)")
        if is_local_fs(fs):  # one listing, kept with its fingerprint
            # A local tree is named by its real path: the same files reached through a symlink reuse its conversions.
            listing = manifest.local_listing(root.rstrip("/") or "/", fs.unstrip_protocol(os.path.realpath(root)),
                                             IMAGE_EXTENSIONS, cache_dir(), relist)
            if not len(listing.paths):
                raise DatasetError(f"{fs.unstrip_protocol(root)}: no images found (expected <class>/<image>.jpg "
                                   "under it)")
            return ImageDataset(root=root, fs=fs, paths=listing.paths, labels=listing.labels, sizes=listing.sizes,
                                classes=listing.classes, fingerprint=listing.fingerprint)
        files = fs.find(root, detail=True)
    prefix = root.rstrip("/") + "/"
    entries = []
    for name, info in files.items():
        relative = name[len(prefix):] if name.startswith(prefix) else name
        parts = relative.split("/")
        if len(parts) == 2 and parts[1].lower().endswith(IMAGE_EXTENSIONS):
            entries.append((parts[0], name, info.get("size")))
    with storage_errors(url, "list the dataset"):
        entries = _with_sizes(fs, entries)
    if not entries:
        raise DatasetError(f"{fs.unstrip_protocol(root)}: no images found (expected <class>/<image>.jpg under it)")
    entries.sort()
    classes = sorted({c for c, _, _ in entries})
    class_index = {c: i for i, c in enumerate(classes)}
    # Modification times too: a file replaced by other bytes of the same size makes a new dataset (its
    # conversions are not reused); `loadopt convert --verify` also compares the content.
    digest = manifest.fingerprint(fs.unstrip_protocol(root), [name[len(prefix):] for _, name, _ in entries],
                                  [size for _, _, size in entries],
                                  [modified(files.get(name) or {}) for _, name, _ in entries])
    return ImageDataset(
        root=fs.unstrip_protocol(root),
        fs=fs,
        paths=np.array([n.encode() for _, n, _ in entries]),
        labels=np.array([class_index[c] for c, _, _ in entries], dtype=np.int64),
        sizes=np.array([s for _, _, s in entries], dtype=np.int64),
        classes=classes,
        fingerprint=digest,
    )


def modified(info: dict[str, Any]) -> str:
    """A file's modification time as its filesystem lists it (local disks and object stores; "" where
    the listing has none, as plain HTTP directory listings)."""
    for key in ("mtime", "LastModified", "last_modified", "updated"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def _with_sizes(fs: fsspec.AbstractFileSystem, entries: list[tuple[str, str, Any]]) -> list[tuple[str, str, int]]:
    """Entries with their stored sizes: HTTP directory listings carry none, so ask for them (HEAD)."""
    missing = [name for _, name, size in entries if size is None]
    if not missing:
        return entries
    with ThreadPoolExecutor(16) as pool:  # one round trip each: overlap them
        sizes = dict(zip(missing, pool.map(fs.size, missing), strict=True))
    return [(c, name, int(size if size is not None else sizes[name] or 0)) for c, name, size in entries]


def _from_manifest(root: Path, split: str) -> ImageDataset | None:
    """The synthetic dataset's listing from its manifest (no directory walk)."""
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    files = [f for f in manifest["files"] if f[0].startswith(split + "/")]
    if not files:
        return None
    labels = np.array([f[2] for f in files], dtype=np.int64)
    classes = [f[0].split("/")[1] for f in (files[int(i)] for i in np.unique(labels, return_index=True)[1])]
    return ImageDataset(
        root=str(root / split),
        fs=fsspec.filesystem("file"),
        paths=np.char.add(f"{root}/".encode(), np.array([f[0] for f in files], dtype=np.bytes_)),
        labels=labels,
        sizes=np.array([f[1] for f in files], dtype=np.int64),
        classes=classes,
        fingerprint=root.name,  # synthetic-<key> for train (as ever), synthetic-<key>-val<count> for val
        synthetic=True,
    )


def open_dataset(config: Config, split: str = "train", progress: Callable[[int, int], None] | None = None):
    """The dataset a config names (its `dataset.path`, the tier's `base`, or the synthetic one, generated if
    missing), read through `storage.tier`.

    Images give an `ImageDataset`, a `WebDataset` or a `ParquetDataset` (`dataset.format`);
    `dataset.kind: tokens` a `TokenDataset` (one split: the file);
    `dataset.kind: records` a `RecordDataset` (storage/records.py; one split: the folder).
    """
    tier = resolve_tier(config.storage.tier, where=f"{config.source}: storage.tier")
    if config.dataset.kind == "tokens":
        if tier.base is not None or tier.emulates():
            raise ConfigError(f"{config.source}: storage.tier: token corpora are memory-mapped from a local file; "
                              "tiers apply to image datasets (use storage.tier: local)")
        return _open_tokens(config, progress)
    path = dataset_root(tier, config.dataset.path, where=config.source)
    dataset: ImageDataset | RecordDataset | WebDataset | ParquetDataset
    if config.dataset.kind == "records":
        dataset = _open_records(config, path, tier.storage_options, progress)
    elif path is not None:
        dataset = _open_images(config, path, split, tier.storage_options)
    else:
        dataset = _open_synthetic(config, split, progress)
    dataset.fs = tier_filesystem(tier, dataset.fs)  # reads go through the tier (itself when it imposes nothing)
    dataset.converted = conversion_home(config.storage.converted, tier.base, dataset.fs, dataset.root)
    return dataset


def _open_images(config: Config, path: str, split: str, storage_options: dict[str, Any] | None
                 ) -> ImageDataset | WebDataset | ParquetDataset:
    """The images at `path` in the format `dataset.format` names, or the one it holds (`auto`)."""
    spec = config.dataset
    source_format: str = spec.format
    if source_format == "auto":
        from loadopt.storage.source_format import detect_format

        fs, inner = open_url(path, storage_options)
        with storage_errors(path, "look at the dataset"):
            source_format = detect_format(fs, inner, split, redact(path))
    if source_format == "webdataset":
        from loadopt.storage.webdataset_source import open_webdataset

        return open_webdataset(path, split, storage_options, spec.label_key, spec.on_error)
    if source_format == "parquet":
        from loadopt.storage.parquet_source import open_parquet

        return open_parquet(path, split, storage_options, spec.columns.image, spec.columns.label)
    return scan_image_folder(path, split, storage_options)


def _open_synthetic(config: Config, split: str, progress: Callable[[int, int], None] | None) -> ImageDataset:
    from loadopt.storage.synthetic import ensure_synthetic

    try:
        root = ensure_synthetic(config.dataset.synthetic, cache_dir(), progress=progress, split=split)
    except ValueError as exc:  # a split it does not have
        raise DatasetError(f"{config.source}: dataset.synthetic: {exc}") from None
    except OSError as exc:
        from loadopt.storage import integrity

        if is_no_space(exc):  # the partial folder is already gone (synthetic.ensure_synthetic)
            spec = config.dataset.synthetic  # JPEGs of these images at quality 90: about 0.8 bytes a pixel
            needed = int(spec.num_samples * spec.mean_width * spec.mean_height * 0.8)
            raise integrity.no_space_error(cache_dir() / "datasets", needed, "the synthetic dataset") from None
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic dataset into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    dataset = _from_manifest(root, split)
    if dataset is None:
        raise DatasetError(f"{root}: the synthetic dataset has no split {split!r}")
    return dataset


def _open_records(config: Config, path: str | None, storage_options: dict[str, Any] | None,
                  progress: Callable[[int, int], None] | None) -> RecordDataset:
    from loadopt.storage import integrity
    from loadopt.storage.records import ensure_records, open_records, record_sizes

    spec = config.dataset.records
    if path is not None:
        return open_records(path, spec, storage_options)
    try:
        folder = ensure_records(spec, cache_dir(), progress=progress)
    except OSError as exc:
        if is_no_space(exc):  # the partial folder is already gone (records.ensure_records)
            needed = int(record_sizes(spec).sum()) * spec.samples_per_file
            raise integrity.no_space_error(cache_dir() / "datasets", needed, "the synthetic records") from None
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic records into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    return open_records(str(folder), spec, synthetic=True)


def _open_tokens(config: Config, progress: Callable[[int, int], None] | None):
    from loadopt.storage.tokens import ensure_tokens, open_tokens

    spec, seq_len = config.dataset.tokens, config.pipeline.seq_len
    if config.dataset.path is not None:
        path = os.path.expanduser(config.dataset.path)
        if "://" in path and not path.startswith("file://"):
            raise DatasetError(f"{path}: token files are memory-mapped and must be on a local file system")
        return open_tokens(path.removeprefix("file://"), spec, seq_len)
    try:
        corpus = ensure_tokens(spec, cache_dir(), progress=progress)
    except OSError as exc:
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic token corpus into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    return open_tokens(corpus, spec, seq_len, synthetic=True)
