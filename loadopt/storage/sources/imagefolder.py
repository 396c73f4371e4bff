"""ImageFolder datasets (`<root>/<split>/<class>/<image>`) on any fsspec filesystem.

The listing is done once, in the consumer process, and kept in numpy arrays (no per-sample Python
objects: forked workers would otherwise touch every refcount and copy the pages). A real dataset is
only ever read; the synthetic one is generated into the cache on first use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import fsspec
import numpy as np

from loadopt.config_models import Config
from loadopt.errors import ConfigError, DatasetError
from loadopt.files import cache_dir, is_no_space
from loadopt.imaging import jxl
from loadopt.storage.forms.placement import conversion_home
from loadopt.storage.remote import listing as remote_listing
from loadopt.storage.remote.access import display_name, is_local_fs, open_url, redact, storage_errors, why_missing
from loadopt.storage.remote.listing import ListingKey, SavedListing
from loadopt.storage.sources import manifest
from loadopt.storage.sources.format import what_is_there
from loadopt.storage.sources.records import RecordDataset
from loadopt.storage.tiers.spec import dataset_root, resolve_tier
from loadopt.storage.tiers.stack import tier_filesystem

if TYPE_CHECKING:  # they import this module's helpers
    from loadopt.storage.sources.parquet import ParquetDataset
    from loadopt.storage.sources.webdataset import WebDataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".jxl")


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
    converted: str | None = None  # where its conversions live when not in the cache (storage/forms/tier_reads.py)
    left_out: list[str] = field(default_factory=list)  # samples indexing left out (on_error: skip), named
    listed_at: float | None = None  # when its saved remote listing was taken (storage/remote/listing.py)
    kind: ClassVar[str] = "images"  # what `recipe` and the backends' `supports` tell datasets apart by
    source_format: ClassVar[str] = "imagefolder"

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return self.paths[index].decode()

    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def read(self, index: int) -> bytes:
        """The stored bytes of sample `index` (a recompressed JPEG's JPEG: imaging/jxl.py); plain `open` on local
        disks: no fsspec overhead."""
        if self.is_local():
            with open(self.paths[index], "rb") as handle:
                return jxl.decodable(handle.read())
        name = self.path(index)
        return jxl.decodable(remote_listing.read_listed(self.fs, name, display_name(self.fs, name), self.listed_at,
                                                        int(self.sizes[index])))

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
    in the cache and reused while its folders' mtimes are unchanged (storage/sources/manifest.py says what that
    misses); a remote one's is saved on its first open and read on every later one without a request
    (storage/remote/listing.py); `relist` lists either again regardless."""
    fs, root = open_url(root_url, storage_options)
    if not is_local_fs(fs):
        key = ListingKey.of("imagefolder", root_url, split, storage_options)
        listing = remote_listing.remembered(fs, root, key, relist, lambda: _list_remote(fs, root, split, root_url))
        return ImageDataset(root=fs.unstrip_protocol(listing.root), fs=fs, paths=listing.files,
                            labels=listing.arrays["labels"], sizes=listing.sizes, classes=listing.classes,
                            fingerprint=listing.fingerprint, listed_at=listing.listed_at)
    with storage_errors(root_url, "list the dataset"):
        root = _split_folder(fs, root, split, root_url)
    # A local tree is named by its real path: the same files reached through a symlink reuse its conversions.
    listing_here = manifest.local_listing(root.rstrip("/") or "/", fs.unstrip_protocol(os.path.realpath(root)),
                                          IMAGE_EXTENSIONS, cache_dir(), relist)
    if not len(listing_here.paths):
        raise DatasetError(f"{fs.unstrip_protocol(root)}: no images found (expected <class>/<image>.jpg under it; "
                           f"{what_is_there(fs, root, fs.unstrip_protocol(root))})")
    return ImageDataset(root=root, fs=fs, paths=listing_here.paths, labels=listing_here.labels,
                        sizes=listing_here.sizes, classes=listing_here.classes, fingerprint=listing_here.fingerprint)


def _split_folder(fs: fsspec.AbstractFileSystem, root: str, split: str, url: str) -> str:
    """The split's folder: `<root>/<split>`, else `root` itself for train (a bare class tree)."""
    shown = redact(url)
    if not fs.exists(root):  # remote drivers say False for a host that refused too: ask why
        raise DatasetError(f"{shown}: {why_missing(fs, root, url, 'dataset folder not found')}")
    split_root = root.rstrip("/") + "/" + split
    if fs.isdir(split_root):
        return split_root
    if split != "train" and fs.isdir(root):  # only train may be the root itself (a bare class tree)
        splits = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if fs.isdir(p))
        raise DatasetError(f"{shown}: no split folder {split!r} (expected <root>/{split}/<class>/; folders "
                           f"there: {', '.join(splits) or 'none'})")
    if not fs.isdir(root):
        raise DatasetError(f"{shown}: is not a folder (expected an ImageFolder tree <root>/{split}/<class>/)")
    return root


def _list_remote(fs: fsspec.AbstractFileSystem, root: str, split: str, url: str) -> SavedListing:
    """The split's images on remote storage (`fs.find`, plus a HEAD a file where the listing has no sizes),
    by (class, file name), their labels and fingerprint."""
    with storage_errors(url, "list the dataset"):
        root = _split_folder(fs, root, split, url)
        prefix = root.rstrip("/") + "/"
        entries = []
        for name, info in fs.find(root, detail=True).items():
            parts = (name[len(prefix):] if name.startswith(prefix) else name).split("/")
            if len(parts) == 2 and parts[1].lower().endswith(IMAGE_EXTENSIONS):
                entries.append((parts[0], name, {**info, "name": name}))
        entries.sort(key=lambda entry: entry[:2])
        files = remote_listing.described(fs, [info for _, _, info in entries])
        if not files:
            raise DatasetError(f"{fs.unstrip_protocol(root)}: no images found (expected <class>/<image>.jpg under "
                               f"it; {what_is_there(fs, root, fs.unstrip_protocol(root))})")
    classes = sorted({c for c, _, _ in entries})
    class_index = {c: i for i, c in enumerate(classes)}
    # Modification times too: a file replaced by other bytes of the same size makes a new dataset (its
    # conversions are not reused); `loadopt convert --verify` also compares the content.
    digest = manifest.fingerprint(fs.unstrip_protocol(root), [f.name[len(prefix):] for f in files],
                                  [f.size for f in files], [f.mtime for f in files])
    labels = np.array([class_index[c] for c, _, _ in entries], dtype=np.int64)
    return remote_listing.listing_of(root, files, digest, classes, {"labels": labels})


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


def open_dataset(config: Config, split: str = "train", progress: Callable[[int, int], None] | None = None,
                 relist: bool = False):
    """The dataset a config names (its `dataset.path`, the tier's `base`, or the synthetic one, generated if
    missing), read through `storage.tier`, and with `storage.cache_limit` a dataset not on the local disk through
    a bounded local cache of its files over the tier (storage/remote/shard_cache.py). Its listing is the saved one
    where there is one (a remote dataset's, a local ImageFolder's while its folders are unchanged); `relist`
    lists it again (`--relist`).

    Images give an `ImageDataset`, a `WebDataset` or a `ParquetDataset` (`dataset.format`);
    `dataset.kind: tokens` a `TokenDataset` (one split: the file);
    `dataset.kind: records` a `RecordDataset` (storage/sources/records.py; one split: the folder).
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
        dataset = _open_records(config, path, tier.storage_options, progress, relist)
    elif path is not None:
        dataset = _open_images(config, path, split, tier.storage_options, relist)
    else:
        dataset = _open_synthetic(config, split, progress)
    dataset.fs = tier_filesystem(tier, dataset.fs)  # reads go through the tier (itself when it imposes nothing)
    dataset.converted = conversion_home(config.storage.converted, tier.base, dataset.fs, dataset.root)
    if config.storage.cache_limit is not None:  # over the tier, so that every byte fetched still crosses it
        from loadopt.storage.tiers.stack import cache_reads

        dataset.fs = cache_reads(dataset.fs, path, tier, config.storage.cache_limit, dataset.fingerprint,
                                 config.storage.cache_fetches)
    return dataset


def _open_images(config: Config, path: str, split: str, storage_options: dict[str, Any] | None,
                 relist: bool = False) -> ImageDataset | WebDataset | ParquetDataset:
    """The images at `path` in the format `dataset.format` names, or the one it holds (`auto`: the format
    of its saved listing, asking the storage only where none is saved)."""
    spec = config.dataset
    source_format: str = spec.format
    if source_format == "auto":
        from loadopt.storage.sources import parquet as parquet_source
        from loadopt.storage.sources import webdataset as webdataset_source
        from loadopt.storage.sources.format import detect_format

        fs, inner = open_url(path, storage_options)
        keys = [webdataset_source.listing_key(path, split, storage_options, spec.label_key),
                parquet_source.listing_key(path, split, storage_options, spec.columns.image, spec.columns.label),
                ListingKey.of("imagefolder", path, split, storage_options)]
        saved = [key.source_format for key in keys if not relist and remote_listing.saves_listing(fs, inner)
                 and remote_listing.is_saved(key)]
        if saved:  # detected when it was listed: asking again would cost the requests the listing saves
            source_format = saved[0]
        else:
            with storage_errors(path, "look at the dataset"):
                source_format = detect_format(fs, inner, split, redact(path))
    if source_format == "webdataset":
        from loadopt.storage.sources.webdataset import open_webdataset

        return open_webdataset(path, split, storage_options, spec.label_key, spec.on_error, relist,
                               _index_through_cache(config, path))
    if source_format == "parquet":
        from loadopt.storage.sources.parquet import open_parquet

        return open_parquet(path, split, storage_options, spec.columns.image, spec.columns.label, relist,
                            spec.on_error)
    return scan_image_folder(path, split, storage_options, relist)


def _index_through_cache(config: Config, path: str):
    """With `storage.cache_limit`, remote tar shards are indexed through the tier and the shard cache: indexing
    reads each shard whole, so its copy is kept and the first epoch reads it instead of fetching it again."""
    limit = config.storage.cache_limit
    if limit is None:
        return None
    tier = resolve_tier(config.storage.tier, where=f"{config.source}: storage.tier")

    def through(fs: fsspec.AbstractFileSystem, fingerprint: str) -> fsspec.AbstractFileSystem:
        from loadopt.storage.tiers.stack import cache_reads

        if tier.base is None and is_local_fs(fs):  # read where it is (open_dataset says so once)
            return fs
        return cache_reads(tier_filesystem(tier, fs), path, tier, limit, fingerprint)

    return through


def _open_synthetic(config: Config, split: str, progress: Callable[[int, int], None] | None) -> ImageDataset:
    from loadopt.storage.sources.synthetic import ensure_synthetic

    try:
        root = ensure_synthetic(config.dataset.synthetic, cache_dir(), progress=progress, split=split)
    except ValueError as exc:  # a split it does not have
        raise DatasetError(f"{config.source}: dataset.synthetic: {exc}") from None
    except OSError as exc:
        from loadopt.storage.forms import integrity

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
                  progress: Callable[[int, int], None] | None, relist: bool = False) -> RecordDataset:
    from loadopt.storage.forms import integrity
    from loadopt.storage.sources.records import ensure_records, open_records, record_sizes

    spec = config.dataset.records
    if path is not None:
        return open_records(path, spec, storage_options, relist=relist)
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
    from loadopt.storage.sources.tokens import ensure_tokens, open_tokens

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
