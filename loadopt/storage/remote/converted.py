"""A conversion whose home is remote storage (`storage.converted` on S3, GCS, ...): its shard data written
straight there, by whichever process or Ray task wrote the shard, and only its reference kept on the local disk
(the manifest, each shard's entry, and its index rows (raw, ~40 bytes a sample) or its outline (Arrow: every byte
of the shard file but the samples')).

A shard is written on the writer's own disk (a temporary folder in its cache), read back against the checksums
taken while writing it, uploaded under a temporary name, renamed, and its size on the remote checked; the writer
returns the shard's small files (`ShardUpload`) and the conversion's process files them in its work folder, the
entry last (as the shard work does: the resume, the manifest once every shard is there). The finished reference
is then uploaded beside the data, the manifest last (`publish`, after removing what killed writers left there), so
another machine opens the conversion from the remote manifest and index files (or outlines) alone
(`fetch_reference`) and reads every byte of data through the tier. A Ray task therefore needs no folder shared
with the driver.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from loadopt.errors import DatasetError
from loadopt.files import cache_dir
from loadopt.storage.forms import integrity, placement, shard_work
from loadopt.storage.forms.placement import refused, remote_home, remote_path
from loadopt.storage.remote.access import redact

log = logging.getLogger(__name__)

# Storage held in one process's memory: a forked writer or a Ray task would write its own copy. A conversion there is
# made whole in the local cache and uploaded by its first reader.
PROCESS_LOCAL = ("memory",)


@dataclass
class RemoteShards:
    """The remote folder of a conversion (`folder`, in `fs`'s own naming) that holds its shard data."""

    base: fsspec.AbstractFileSystem
    folder: str
    _pid: int = field(default_factory=os.getpid, repr=False)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem; a fresh instance in a forked writer (async clients, s3fs's among them, are bound to the
        parent's event loop and refuse to run after a fork), as the tier's own base (`EmulatedFileSystem`)."""
        if self._pid != os.getpid():
            self.base, self._pid = pickle.loads(pickle.dumps(self.base)), os.getpid()
        return self.base

    def path(self, name: str) -> str:
        return f"{self.folder}/{name}"

    def where(self, name: str = "") -> str:
        """`name` (or the folder) as a URL for messages, credentials removed."""
        return redact(self.fs.unstrip_protocol(self.path(name) if name else self.folder))

    def upload(self, local: Path, name: str) -> None:
        """`local` as `name` in the folder: uploaded under a temporary name, renamed, its size checked."""
        target = self.path(name)
        tmp = self.path(integrity.temp_path(Path(name)).name)
        size = local.stat().st_size
        try:
            self.fs.makedirs(self.folder, exist_ok=True)
            self.fs.put_file(str(local), tmp)
            self.fs.mv(tmp, target)
            have = self.fs.info(target)["size"]
        except Exception as exc:  # noqa: BLE001 - each filesystem fails a refused write its own way
            raise DatasetError(f"{self.where(name)}: cannot write the shard there ({type(exc).__name__}: "
                               f"{redact(str(exc)).splitlines()[0] if str(exc) else 'refused'})") from None
        if have != size:
            raise DatasetError(f"{self.where(name)}: {have} bytes arrived of the {size} uploaded")

    def sizes(self) -> dict[str, int]:
        """Each file's size in the folder, by name (one listing)."""
        try:
            found = self.fs.find(self.folder, detail=True)
        except FileNotFoundError:
            return {}
        return {path.rsplit("/", 1)[-1]: int(info["size"]) for path, info in found.items()}

    def chunks(self, name: str, chunks: list[int]) -> Iterator[tuple[int, bytes]]:
        """(chunk number, bytes) of the given `integrity.CHUNK_BYTES` chunks of the file `name`."""
        for c in chunks:
            at = c * integrity.CHUNK_BYTES
            yield c, self.fs.cat_file(self.path(name), start=at, end=at + integrity.CHUNK_BYTES)

    def download(self, name: str, local: Path) -> None:
        """The file `name` of the folder to `local`."""
        self.fs.get_file(self.path(name), str(local))

    def copy(self, source: RemoteShards, name: str, target: str) -> None:
        """The file `name` of another conversion's folder as `target` here (a copy on the storage itself)."""
        self.fs.copy(source.path(name), self.path(target))

    def remove_leftovers(self) -> list[str]:
        """Remove the temporary files (`integrity.temp_path` names) that writers killed between their upload and
        its rename left in the folder; called once every shard is there and verified, under the conversion's lock,
        when no writer of it runs. Returns their names."""
        names = [name for name in self.sizes() if name.startswith(".") and name.endswith(".tmp")]
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(name))
        return names

    def unfinish(self) -> None:
        """Remove the folder's manifest: a conversion rewritten in place is unfinished until its new one is there."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(shard_work.MANIFEST))


def destination(dataset: Any, final: Path) -> RemoteShards | None:
    """Where the shard data of the conversion `final` goes when the dataset's conversions live on remote
    storage; None when they live on the local disk."""
    home, target = remote_home(dataset), remote_path(dataset, final)
    if home is None or target is None or home[0].protocol in PROCESS_LOCAL:
        return None
    return RemoteShards(home[0], target)


def moved_away(data: RemoteShards | None) -> bool:
    """Whether the remote home of a conversion's data (a reference's `data_home`) holds no finished conversion:
    `storage.converted` was changed since the reference here was made."""
    return data is not None and not data.fs.exists(data.path(shard_work.MANIFEST))


def converted_elsewhere_since(final: Path, data: RemoteShards | None) -> bool:
    """`moved_away`, said in a warning: the finished conversion `final` is made again at its new home (the data
    at the old one is left as it is)."""
    if data is None or not moved_away(data):
        return False
    log.warning("%s: its shards are not at %s (storage.converted changed since): converting there", final,
                data.where())
    return True


def writable_destination(dataset: Any, final: Path) -> RemoteShards | None:
    """`destination`, once a small write there has worked. Refused: None where the home is the default beside
    the source (the conversions stay in the local cache, `placement.refused`), an error for `storage.converted`."""
    remote = destination(dataset, final)
    if remote is None:
        return None
    probe = remote.path(integrity.temp_path(Path("probe")).name)
    try:
        remote.fs.makedirs(remote.folder, exist_ok=True)
        remote.fs.pipe_file(probe, b"")
        remote.fs.rm_file(probe)
    except Exception as exc:  # noqa: BLE001 - each filesystem fails a refused write its own way
        refused(dataset, remote.fs, remote.folder, exc)
        return None
    return remote


def data_home(dataset: Any, final: Path, what: str, shard_name: Callable[[int], str]) -> RemoteShards | None:
    """The remote folder holding the shard data of the finished conversion `final` (a manifest of `what`, its
    shards named by `shard_name`) when `final` holds its reference only; None when the data is in `final` itself
    or there is no finished conversion."""
    try:
        shards = len(shard_work.read_manifest(final, what)["shard_table"])
    except DatasetError:
        return None
    remote = destination(dataset, final)
    if remote is None or all((final / shard_name(k)).exists() for k in range(shards)):
        return None
    return remote


@dataclass
class ShardUpload:
    """A shard written to the remote folder: its entry and the small files the conversion's folder keeps."""

    entry: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)


def write_and_upload(write: Callable[..., Any], remote: RemoteShards, data_name: Callable[[int], str],
                     work: Path | None, job: shard_work.ShardJob, workers: int,
                     written: Callable[[int], None] | None) -> ShardUpload:
    """On the shard's writer (this process, a forked one, a Ray task): shard `job` written by `write` into a
    temporary folder of this machine's cache, its data file uploaded to `remote`, its small files returned. `work`
    (the conversion's own folder) is not used: it may be on another machine."""
    with scratch(f"upload-{job.k}") as folder:
        entry = write(folder, job, workers, written)
        name = data_name(job.k)
        remote.upload(folder / name, name)
        files = {p.name: p.read_bytes() for p in folder.iterdir()
                 if p.name not in (name, shard_work.entry_name(job.k)) and not p.name.startswith(".")}
        return ShardUpload(dict(entry), files)


@contextlib.contextmanager
def scratch(name: str) -> Iterator[Path]:
    """A temporary folder `name` in this machine's cache for a shard on its way to or from the remote folder,
    removed after (and by the next writer here when this process is killed)."""
    folder = cache_dir() / "raw"
    folder.mkdir(parents=True, exist_ok=True)
    integrity.remove_dead_temps(folder)  # what a writer killed on this machine left
    mine = integrity.temp_path(folder / name)
    mine.mkdir()
    try:
        yield mine
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def receive(work: Path, upload: ShardUpload) -> dict[str, Any]:
    """An uploaded shard's small files put in the conversion's work folder, its entry last (the mark it is done)."""
    for name, data in upload.files.items():
        tmp = integrity.temp_path(work / name)
        tmp.write_bytes(data)
        os.replace(tmp, work / name)
    shard_work.write_text(work / shard_work.entry_name(upload.entry["shard"]), json.dumps(upload.entry))
    return upload.entry


def publish(dataset: Any, built: Path, remote: RemoteShards) -> None:
    """A finished conversion's reference (`built`) uploaded beside its data in `remote`, its manifest last, after
    the leftovers of killed writers are removed there."""
    left = remote.remove_leftovers()
    if left:
        log.info("%s: removed %d temporary file(s) of writers killed mid-upload", remote.where(), len(left))
    placement.publish(dataset, built, marker=shard_work.MANIFEST)


def fetch_reference(dataset: Any, final: Path, small_names: Callable[[dict[str, Any]], list[str]]) -> bool:
    """The reference of a conversion finished on the remote home (by another machine, or before this cache was
    emptied) fetched into `final`: its manifest and the small files `small_names(manifest)` lists, never the data.
    False when the home is local or holds no finished conversion there."""
    remote = destination(dataset, final)
    if remote is None or (final / shard_work.MANIFEST).exists():
        return False
    try:
        if not remote.fs.exists(remote.path(shard_work.MANIFEST)):
            return False
        meta = json.loads(remote.fs.cat_file(remote.path(shard_work.MANIFEST)))
        names = small_names(meta)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{remote.where(shard_work.MANIFEST)}: cannot read the conversion's manifest "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = integrity.temp_path(final)
    tmp.mkdir()
    try:
        if names:
            remote.fs.get([remote.path(n) for n in names], [str(tmp / n) for n in names])
        shard_work.write_text(tmp / shard_work.MANIFEST, json.dumps(meta))
        try:
            os.replace(tmp, final)
        except OSError:  # another process fetched it meanwhile
            if not (final / shard_work.MANIFEST).exists():
                raise
    except FileNotFoundError as exc:
        raise DatasetError(f"{remote.where()}: the conversion's manifest lists a file that is not there "
                           f"({exc.filename or exc}): rebuild it with `loadopt convert CONFIG --force ...`") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True
