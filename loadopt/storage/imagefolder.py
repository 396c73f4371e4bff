"""ImageFolder datasets (`<root>/<split>/<class>/<image>`) on any fsspec filesystem.

The listing is done once, in the consumer process, and kept in numpy arrays (no per-sample Python
objects: forked workers would otherwise touch every refcount and copy the pages). A real dataset is
only ever read; the synthetic one is generated into the cache on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np

from loadopt.config import Config, cache_dir
from loadopt.errors import DatasetError

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

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return self.paths[index].decode()

    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    def read(self, index: int) -> bytes:
        """The stored bytes of sample `index` (plain `open` on local disks: no fsspec overhead)."""
        if self.is_local():
            with open(self.paths[index], "rb") as handle:
                return handle.read()
        return self.fs.cat_file(self.path(index))

    def local_files(self) -> list[str]:
        """Every sample file when the dataset is on a local disk, else empty."""
        return [p.decode() for p in self.paths] if self.is_local() else []


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def scan_image_folder(root_url: str, split: str = "train") -> ImageDataset:
    """List `<root>/<split>/<class>/*`; when `<root>/<split>` is absent, `root` is taken as the split."""
    try:
        fs, root = fsspec.core.url_to_fs(root_url)
    except (ImportError, ValueError) as exc:
        raise DatasetError(f"{root_url}: cannot open this location ({exc})") from None
    try:
        if not fs.exists(root):
            raise DatasetError(f"{root_url}: dataset folder not found")
        split_root = root.rstrip("/") + "/" + split
        if fs.isdir(split_root):
            root = split_root
        elif not fs.isdir(root):
            raise DatasetError(f"{root_url}: is not a folder (expected an ImageFolder tree <root>/{split}/<class>/)")
        files = fs.find(root, detail=True)
    except DatasetError:
        raise
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{root_url}: cannot list the dataset ({exc})") from None
    prefix = root.rstrip("/") + "/"
    entries = []
    for name, info in files.items():
        relative = name[len(prefix):] if name.startswith(prefix) else name
        parts = relative.split("/")
        if len(parts) == 2 and parts[1].lower().endswith(IMAGE_EXTENSIONS):
            entries.append((parts[0], name, int(info.get("size") or 0)))
    if not entries:
        raise DatasetError(f"{fs.unstrip_protocol(root)}: no images found (expected <class>/<image>.jpg under it)")
    entries.sort()
    classes = sorted({c for c, _, _ in entries})
    class_index = {c: i for i, c in enumerate(classes)}
    digest = hashlib.sha256(fs.unstrip_protocol(root).encode())
    for _, name, size in entries:
        digest.update(f"{name[len(prefix):]}\0{size}\n".encode())
    return ImageDataset(
        root=fs.unstrip_protocol(root) if "file" not in _protocols(fs) else root,
        fs=fs,
        paths=np.array([n.encode() for _, n, _ in entries]),
        labels=np.array([class_index[c] for c, _, _ in entries], dtype=np.int64),
        sizes=np.array([s for _, _, s in entries], dtype=np.int64),
        classes=classes,
        fingerprint=digest.hexdigest()[:16],
    )


def _from_manifest(root: Path, split: str) -> ImageDataset | None:
    """The synthetic dataset's listing from its manifest (no directory walk)."""
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    files = [f for f in manifest["files"] if f[0].startswith(split + "/")]
    if not files:
        return None
    classes = sorted({f[0].split("/")[1] for f in files})
    return ImageDataset(
        root=str(root / split),
        fs=fsspec.filesystem("file"),
        paths=np.array([str(root / f[0]).encode() for f in files]),
        labels=np.array([f[2] for f in files], dtype=np.int64),
        sizes=np.array([f[1] for f in files], dtype=np.int64),
        classes=classes,
        fingerprint="synthetic-" + root.name.rsplit("-", 1)[-1],
        synthetic=True,
    )


def open_dataset(config: Config, split: str = "train", progress: Callable[[int, int], None] | None = None):
    """The dataset a config names: its `dataset.path`, or the synthetic one (generated if missing).

    Images give an `ImageDataset`; `dataset.kind: tokens` a `TokenDataset` (one split: the file).
    """
    if config.dataset.kind == "tokens":
        return _open_tokens(config, progress)
    if config.dataset.path is not None:
        return scan_image_folder(os.path.expanduser(config.dataset.path), split)
    from loadopt.storage.synthetic import ensure_synthetic

    try:
        root = ensure_synthetic(config.dataset.synthetic, cache_dir(), progress=progress)
    except OSError as exc:
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic dataset into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    dataset = _from_manifest(root, split)
    if dataset is None:
        raise DatasetError(f"{root}: the synthetic dataset has no split {split!r}")
    return dataset


def _open_tokens(config: Config, progress: Callable[[int, int], None] | None):
    from loadopt.storage.tokens import ensure_tokens, open_tokens

    spec, seq_len = config.dataset.tokens, config.pipeline.seq_len
    if config.dataset.path is not None:
        path = os.path.expanduser(config.dataset.path)
        if "://" in path and not path.startswith("file://"):
            raise DatasetError(f"{path}: token files are memory-mapped and must be on a local file system")
        return open_tokens(path.removeprefix("file://"), spec, seq_len)
    try:
        path = ensure_tokens(spec, cache_dir(), progress=progress)
    except OSError as exc:
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic token corpus into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    return open_tokens(path, spec, seq_len, synthetic=True)
