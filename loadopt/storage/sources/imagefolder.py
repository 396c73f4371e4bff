"""ImageFolder datasets (`<root>/<split>/<class>/<image>`) on any fsspec filesystem.

The listing is done once, in the consumer process, and kept in numpy arrays (no per-sample Python
objects: forked workers would otherwise touch every refcount and copy the pages). A real dataset is
only ever read; the synthetic one is generated into the cache on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import fsspec
import numpy as np

from loadopt.errors import DatasetError
from loadopt.files import cache_dir
from loadopt.imaging import jxl
from loadopt.storage.remote import listing as remote_listing
from loadopt.storage.remote.access import display_name, is_local_fs, open_url, redact, storage_errors, why_missing
from loadopt.storage.remote.listing import ListingKey, SavedListing
from loadopt.storage.sources import manifest
from loadopt.storage.sources.format import what_is_there
from loadopt.storage.sources.request import SourceRequest

if TYPE_CHECKING:  # they import this module's helpers
    pass

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
    converted: str | None = None  # where its conversions live when not in the cache (`conversion_home`)
    left_out: list[str] = field(default_factory=list)  # samples indexing left out (on_error: skip), named
    listed_at: float | None = None  # when its saved remote listing was taken
    kind: ClassVar[str] = "images"  # what `recipe` and the backends' `supports` tell datasets apart by
    source_format: ClassVar[str] = "imagefolder"

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return self.paths[index].decode()

    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def read(self, index: int) -> bytes:
        """The stored bytes of sample `index` (a recompressed JPEG's JPEG); plain `open` on local
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
    in the cache and reused while its folders' mtimes are unchanged (`manifest` says what that
    misses); a remote one's is saved on its first open and read on every later one without a request;
    `relist` lists either again regardless."""
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


def open_source(request: SourceRequest) -> ImageDataset:
    """An ImageFolder split at `request.path`."""
    assert request.path is not None, "an ImageFolder is opened where it is"
    return scan_image_folder(request.path, request.split, request.storage_options, request.relist)
