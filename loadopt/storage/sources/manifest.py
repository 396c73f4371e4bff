"""The listing of a local ImageFolder split, kept in the cache beside its fingerprint (the manifest).

Opening a dataset lists every file and fingerprints the listing (names, sizes, modification times):
one `stat` a file, minutes at ImageNet-21k's 14M files. The listing is saved as numpy arrays
(`<cache>/manifests/<key>/`: paths, labels and sizes as `.npy`, the modification time of the split
folder and of each of its subfolders, and `meta.json` with the class names and the fingerprint) and
reused while none of those folders' modification times changed: one `stat` a folder (1,001 for
ImageNet-1k), no per-sample Python work, the arrays memory-mapped (read-only: every rank and worker on a
machine shares one copy of their pages, the page cache's).

What a folder's modification time sees: a file added, removed or renamed in it (so a file replaced by
writing a temporary and renaming it, as most tools do), a class folder added, removed or renamed. A
symlinked class folder is followed (as torchvision's ImageFolder does) and watched through its target
(`os.stat` follows the link); the link itself replaced or removed changes the split folder's mtime.
What it misses, by design (the price of not stat-ing every file): a file rewritten in place (opened for
writing, same name: its own mtime and size change, its folder's do not: `rsync --inplace`, `cp` over an
existing file, an editor saving in place) or its mtime touched. While the listing is reused such a change keeps
the old fingerprint, so a conversion of the old bytes is reused. `--relist` (`relist=True`: `make_loader`,
`scan_image_folder`) lists the folders again, a `stat` per file, so a changed mtime or size is a new dataset;
`loadopt convert --verify` lists again too and compares every sample's bytes with the digest the conversion
recorded (a file rewritten with its old size and mtime kept), reconverting on a difference.

The staleness rule: a saved listing is reused exactly while every watched folder's mtime (ns) is the one
stat-ed before that folder was read, so a change made during or after the listing is seen. Timestamps are
coarse (a kernel tick; seconds on some filesystems): a change in the same tick as the folder's recorded mtime
would leave it equal, so a listing is saved only when every watched folder's mtime is at least `RACY_SECONDS`
older than the listing's start; a newer one (or one in the future) is listed again on the next open. This
assumes the filesystem's clock agrees with this machine's within `RACY_SECONDS`: on a network filesystem whose
server's clock is behind, list with `--relist` after writing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MANIFEST_VERSION = 2
META = "meta.json"
RACY_SECONDS = 2.0  # a folder modified this recently when listed may change again within its mtime's tick


@dataclass
class Listing:
    """One split's samples, sorted by (class, file name), as `ImageDataset` holds them."""

    paths: np.ndarray  # fixed-width UTF-8 bytes: the file names as the filesystem lists them
    labels: np.ndarray  # int64, index into `classes`
    sizes: np.ndarray  # int64, stored bytes
    classes: list[str]
    fingerprint: str
    cached: bool = False  # read from the manifest (no listing)


def fingerprint(identity: str, relative: list[str], sizes: list[int], mtimes: list[str]) -> str:
    """16 hex digits naming the dataset: `identity` (its root) and every file's relative name, size and
    modification time (the listing's own form of it; "" where it has none), fed to one digest in bulk."""
    digest = hashlib.sha256(identity.encode())
    _digest_lines(digest, relative, sizes, mtimes)
    return digest.hexdigest()[:16]


def _digest_lines(digest: Any, relative: list[str], sizes: list[int], mtimes: list[str]) -> None:
    lines = "".join([f"{name}\0{size}\0{mtime}\n" for name, size, mtime in zip(relative, sizes, mtimes, strict=True)])
    digest.update(lines.encode())


def manifest_path(root: str, cache: Path) -> Path:
    """Where the listing of the split folder `root` is kept (keyed by the name it is opened by)."""
    return cache / "manifests" / hashlib.sha256(root.encode()).hexdigest()[:24]


def _is_image(name: str, extensions: tuple[str, ...]) -> bool:
    return name.lower().endswith(extensions)


def _list_class(class_path: str, extensions: tuple[str, ...]) -> list[tuple[str, int, str]]:
    """(file, size, mtime) of the images in one class folder, by name."""
    found = []
    with os.scandir(class_path) as inside:
        for entry in inside:
            if entry.is_dir() or not _is_image(entry.name, extensions):
                continue
            own = entry.stat(follow_symlinks=False)
            size = own.st_size
            if entry.is_symlink():
                try:
                    size = entry.stat().st_size
                except OSError:
                    size = 0
            found.append((entry.name, size, str(own.st_mtime)))
    found.sort()
    return found


def _class_folders(root: str) -> list[tuple[str, str]]:
    """(name, path) of the class folders of `root`, by name: symlinked ones followed, as torchvision's
    ImageFolder does; a link whose target is missing, or is `root` or a folder above it (a loop: it would
    hold the other classes), is left out with a warning."""
    real_root = os.path.realpath(root)
    found = []
    with os.scandir(root) as top:
        for entry in top:
            if entry.is_dir(follow_symlinks=False):
                found.append((entry.name, entry.path))
            elif entry.is_symlink():
                target = os.path.realpath(entry.path)
                if not os.path.isdir(target):
                    if not os.path.exists(target):
                        log.warning("%r -> %r: the link's target is missing; class %r left out", entry.path,
                                    os.readlink(entry.path), entry.name)
                    continue
                if real_root == target or real_root.startswith(target.rstrip("/") + "/"):
                    log.warning("%r -> %r: links back to the dataset's own folder (a loop); class %r left out",
                                entry.path, os.readlink(entry.path), entry.name)
                    continue
                found.append((entry.name, entry.path))
    return sorted(found)


def list_local(root: str, identity: str, extensions: tuple[str, ...]) -> tuple[Listing, np.ndarray, np.ndarray]:
    """Walk `<root>/<class>/<file>` with `os.scandir` (a `stat` per file, as fsspec's local `find`
    gives the same names, sizes and mtimes: a symlinked file's own mtime, its target's size). Symlinked
    class folders are followed (`_class_folders`) and watched through their targets. One class folder at
    a time: its entries are digested and turned into arrays before the next is listed, so the Python
    objects held are one class's, not the dataset's. Also returns the folders watched (root first) and
    their mtimes (ns)."""
    started = time.time()
    folders, folder_mtimes = [root], [os.stat(root).st_mtime_ns]
    classes_found = _class_folders(root)
    digest = hashlib.sha256(identity.encode())
    classes: list[str] = []
    paths, labels, sizes = [], [], []
    for class_name, class_path in classes_found:
        try:
            mtime = os.stat(class_path).st_mtime_ns
            found = _list_class(class_path, extensions)
        except FileNotFoundError:  # removed while listed: the next open lists again (the root's mtime differs)
            continue
        folders.append(class_path)
        folder_mtimes.append(mtime)
        if not found:
            continue
        relative = [f"{class_name}/{name}" for name, _, _ in found]
        class_sizes = [size for _, size, _ in found]
        _digest_lines(digest, relative, class_sizes, [m for _, _, m in found])
        paths.append(np.array([f"{root}/{r}".encode() for r in relative]))
        sizes.append(np.array(class_sizes, dtype=np.int64))
        labels.append(np.full(len(found), len(classes), dtype=np.int64))
        classes.append(class_name)
    listing = Listing(
        paths=np.concatenate(paths) if paths else np.array([], dtype="S1"),
        labels=np.concatenate(labels) if labels else np.array([], dtype=np.int64),
        sizes=np.concatenate(sizes) if sizes else np.array([], dtype=np.int64),
        classes=classes,
        fingerprint=digest.hexdigest()[:16],
    )
    mtimes = np.array(folder_mtimes, dtype=np.int64)
    racy = bool(len(mtimes)) and mtimes.max() / 1e9 > started - RACY_SECONDS
    return listing, np.array(folders if not racy else [], dtype=str), mtimes


def save(path: Path, listing: Listing, identity: str, folders: np.ndarray, mtimes: np.ndarray) -> None:
    """Write the manifest folder (a temporary folder renamed into place); best effort: a cache that cannot
    be written costs the next open a listing, nothing else. `folders` empty: the listing was racy, not saved."""
    if not len(folders):
        return
    arrays = {"paths": listing.paths, "labels": listing.labels, "sizes": listing.sizes, "folders": folders,
              "mtimes": mtimes}
    meta = {"version": MANIFEST_VERSION, "identity": identity, "fingerprint": listing.fingerprint,
            "classes": listing.classes}
    write_arrays(path, arrays, meta, "listing manifest")


def write_arrays(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any], what: str) -> bool:
    """The folder `path` holding each array as `<name>.npy` and `meta` as `meta.json`, written in a temporary
    folder renamed into place (a reader sees the old folder or the new one, never half of one). Best effort:
    a cache that cannot be written costs the next open its work again, so a failure is logged (naming
    `what`) and False returned."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir(parents=True)
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / META).write_text(json.dumps(meta))
        _swap_in(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log.debug("%s not saved at %s: %s", what, path, exc)
        return False
    return True


def _swap_in(tmp: Path, path: Path) -> None:
    """The folder written at `tmp` becomes `path`; readers holding the old arrays mapped keep them
    (unlinked files stay mapped)."""
    old = path.with_name(f"{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def forget(root: str, cache: Path) -> None:
    """Remove the manifest of the split folder `root` (the next open lists it)."""
    shutil.rmtree(manifest_path(root, cache), ignore_errors=True)


def size_bytes(path: Path) -> int:
    """Bytes the manifest folder `path` holds on disk (0 when there is none)."""
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else 0


def load(path: Path, identity: str) -> Listing | None:
    """The saved listing when every watched folder's mtime is unchanged (one `stat` each), else None. The
    arrays are memory-mapped read-only: ranks and processes opening the same dataset share their pages."""
    try:
        meta = json.loads((path / META).read_text())
        if meta.get("version") != MANIFEST_VERSION or meta.get("identity") != identity:
            return None
        folders, mtimes = np.load(path / "folders.npy"), np.load(path / "mtimes.npy")
        for folder, mtime in zip(folders.tolist(), mtimes.tolist(), strict=True):
            if os.stat(folder).st_mtime_ns != mtime:
                return None
        paths, labels, sizes = (np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                                for name in ("paths", "labels", "sizes"))
        if not len(paths) == len(labels) == len(sizes):
            return None
        return Listing(paths=paths, labels=labels, sizes=sizes, classes=list(meta["classes"]),
                       fingerprint=str(meta["fingerprint"]), cached=True)
    except (OSError, ValueError, KeyError, TypeError):  # missing, damaged, of another layout: list again
        return None


def local_listing(root: str, identity: str, extensions: tuple[str, ...], cache: Path,
                  relist: bool = False) -> Listing:
    """The listing of the local split folder `root`: from its manifest when no folder changed since it
    was saved (and not `relist`), else walked and saved."""
    path = manifest_path(root, cache)
    if not relist:
        found = load(path, identity)
        if found is not None:
            return found
    listing, folders, mtimes = list_local(root, identity, extensions)
    if len(listing.paths):
        save(path, listing, identity, folders, mtimes)
    return listing


# ---------------------------------------------------------------------------------------------
# Sample indexes of container files (tar shards, Parquet files): built once, reused while the fingerprint holds

INDEX_VERSION = 1


@dataclass
class SampleIndex:
    """Where each sample of a set of container files lives (named arrays, one entry per sample or per file),
    the class names, and the fingerprint of the files it was built from."""

    arrays: dict[str, np.ndarray]
    classes: list[str]
    fingerprint: str
    notes: list[str]  # samples left out while indexing, named for a message


def save_index(path: Path, index: SampleIndex, identity: str) -> None:
    """Write the index folder (a temporary folder renamed into place); best effort, as `save`."""
    meta = {"version": INDEX_VERSION, "identity": identity, "fingerprint": index.fingerprint,
            "classes": index.classes, "arrays": sorted(index.arrays), "notes": index.notes}
    write_arrays(path, index.arrays, meta, "sample index")


def load_index(path: Path, identity: str, fingerprint: str) -> SampleIndex | None:
    """The saved index when it was built from files of this fingerprint, else None (the arrays memory-mapped)."""
    try:
        meta = json.loads((path / META).read_text())
        if (meta.get("version") != INDEX_VERSION or meta.get("identity") != identity
                or meta.get("fingerprint") != fingerprint):
            return None
        arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in meta["arrays"]}
        return SampleIndex(arrays=arrays, classes=list(meta["classes"]), fingerprint=fingerprint,
                           notes=list(meta["notes"]))
    except (OSError, ValueError, KeyError, TypeError):  # missing, damaged, of another layout: index again
        return None
