"""Where a converted form (Arrow files, raw shards) lives for a dataset on a storage tier, and how it gets there.

A dataset on the local disk converts into the cache (`$LOADOPT_CACHE`); an emulated tier over it reads those
files through its limits. A dataset on other storage (a tier's `base`: `s3://`, `http(s)://`, an NFS path) keeps
its conversions on that storage: `storage.converted`, by default `<dataset root>/.loadopt/`, written there shard by
shard by its writers with only its reference kept in the local cache; one made in the local cache before is
uploaded by its first reader (`publish`: the file that marks it finished goes last, a half-uploaded one is never
used). Where the source's storage cannot be written (`http(s)://`; a bucket that refuses the upload) and
`storage.converted` is not set, the conversions stay in the local cache and are read from the local disk. A
`storage.converted` that cannot be written is a one-line error naming it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import fsspec
import numpy as np

from loadopt.errors import ConfigError, DatasetError
from loadopt.storage.dataset import Dataset
from loadopt.storage.remote.access import is_local_fs, redact
from loadopt.storage.tiers.emulated import EmulatedFileSystem
from loadopt.storage.tiers.stack import BASE_BOUND_SHARE, base_bound_text, base_share, storage_under, tier_of

log = logging.getLogger(__name__)

BUSY_ENOUGH = 0.9  # a run keeping its accelerator this busy was bounded by nothing under it (MLPerf's AU bound)
CONVERTED_FOLDER = ".loadopt"  # beside the source, when the dataset is not on the local disk
# Storage a conversion is never written to beside the source: fsspec writes HTTP as POST requests, which
# a static file server refuses and any other server may take for something else.
READ_ONLY_SCHEMES = ("http", "https")
LAYOUT_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i8")])


def tier_fs(dataset: Dataset) -> fsspec.AbstractFileSystem | None:
    """The tier wrapper every read of `dataset` and its conversions must pass through, or None on plain
    local disk (the loaders' direct fast paths)."""
    fs = tier_of(dataset.fs) if dataset.fs is not None else None  # conversions are read past a shard cache
    return fs if isinstance(fs, EmulatedFileSystem) else None


def conversion_tier(dataset: Dataset) -> fsspec.AbstractFileSystem | None:
    """The tier every read of `dataset`'s conversions must pass through: its own (`tier_fs`), except where
    they are kept in the local cache because the source's storage cannot be written (`converted_locally`):
    read from the local disk directly then, as on plain local disk. None: direct reads."""
    return None if converted_locally(dataset) else tier_fs(dataset)


def converted_locally(dataset: Dataset) -> str | None:
    """Why `dataset`'s conversions are in the local cache though it is read from other storage (that
    storage cannot be written); None where they live where its reads go (the cache of a local dataset,
    or the remote home)."""
    tier = tier_fs(dataset)
    if tier is None or dataset.converted is not None or is_local_fs(tier.base_fs):
        return None
    scheme = str(dataset.root).split("://", 1)[0] + "://"
    return f"{redact(scheme)} storage beside the source cannot be written"


def via_tier(dataset: Dataset, conversion: bool = False) -> str:
    """What a loader's label adds when its reads (`conversion`: of the dataset's conversions) go through a
    tier instead of the local fast paths."""
    return " via tier" if (conversion_tier(dataset) if conversion else tier_fs(dataset)) is not None else ""


def bytes_source(dataset: Dataset, conversion: bool = False) -> str:
    """Where a run's bytes came from, for results and tables: the local disk read directly, or the
    tier (emulated limits or not) over the storage under it. `conversion`: of a backend reading the
    dataset's conversions, which may be on the local disk while the source is not."""
    tier = tier_fs(dataset)
    why = converted_locally(dataset) if conversion else None
    if why is not None:
        return f"local disk (direct reads of the conversion in the local cache: {why})"
    if tier is None:
        return "local disk (direct reads)"
    spec = tier.spec
    under = storage_under(tier, str(dataset.root))
    return f"tier {redact(spec.name)} ({'emulated' if spec.emulates() else 'as it is'}) over {under}"


def bounded_by_base(dataset: Dataset, counters: dict[str, float] | None, tier_bytes: float | None,
                    wall_s: float | None, accelerator_utilisation: float | None) -> str | None:
    """For a run through an emulated tier that kept its accelerator waiting (utilisation below
    `BUSY_ENOUGH`) while the storage under the tier slowed its reads past the tier's own figures
    (`base_share` of `counters` at least `BASE_BOUND_SHARE`): what its figures are, at the MB/s the run got
    through the tier (`tier_bytes` in `wall_s`); else None."""
    tier = tier_fs(dataset)
    share = base_share(counters)
    if tier is None or tier.spec.profile_mb_s(1, 1) is None or share is None or share < BASE_BOUND_SHARE \
            or accelerator_utilisation is None or accelerator_utilisation >= BUSY_ENOUGH:
        return None
    mb_s = tier_bytes / wall_s / 1e6 if tier_bytes and wall_s else None
    return (f"reads {base_bound_text(tier.spec.name, storage_under(tier, str(dataset.root)), mb_s)} ({share:.0%} of "
            "their time was the storage under the tier, past the tier's own figures)")


# ---------------------------------------------------------------------------------------------
# Where conversions live


def conversion_home(converted: str | None, tier_base: str | None, fs: fsspec.AbstractFileSystem,
                    root: str) -> str | None:
    """`storage.converted`; else `<root>/.loadopt` when the dataset is on a tier's `base` or not on the
    local disk; None: the local cache."""
    if converted:
        return os.path.expanduser(converted)
    fs = tier_of(fs)
    base_fs = fs.base_fs if isinstance(fs, EmulatedFileSystem) else fs
    if tier_base is None and is_local_fs(base_fs) or root.split("://", 1)[0] in READ_ONLY_SCHEMES:
        return None  # the local cache
    return beside_source(root)


def beside_source(root: str) -> str:
    """The conversions' default home on a dataset's own storage: `<root>/.loadopt`."""
    return root.rstrip("/") + "/" + CONVERTED_FOLDER


def local_dir(dataset: Dataset, default: Path) -> Path:
    """The local folder a conversion of `dataset` is written in: its home when that is a local path,
    else `default` (the cache; for a remote home, the staging place before the upload)."""
    home = dataset.converted
    if home is None or "://" in home and not home.startswith("file://"):
        return default
    return Path(home.removeprefix("file://"))


def remote_home(dataset: Dataset) -> tuple[fsspec.AbstractFileSystem, str] | None:
    """(filesystem, path) of the conversions' home when it is not on the local disk, else None. The
    home must be on the dataset's own storage: its reads pass through the same tier."""
    home = dataset.converted
    if home is None or "://" not in home or home.startswith("file://") or dataset.fs is None:
        return None
    tier = tier_of(dataset.fs)
    base = tier.base_fs if isinstance(tier, EmulatedFileSystem) else tier
    protocols = (base.protocol,) if isinstance(base.protocol, str) else tuple(base.protocol)
    if home.split("://", 1)[0] not in protocols:
        raise ConfigError(f"storage.converted {redact(home)!r}: must be on the dataset's storage "
                          f"({protocols[0]}://), so that reading the conversions passes through its tier")
    return base, base._strip_protocol(home)


def remote_path(dataset: Dataset, local: Path) -> str | None:
    """Where the local conversion `local` (a file or folder in `<kind>/<name>`) lives on the remote
    home, in the base filesystem's own naming; None when the home is local."""
    home = remote_home(dataset)
    if home is None:
        return None
    return home[1].rstrip("/") + f"/{local.parent.name}/{local.name}"


def publish(dataset: Dataset, local: Path, marker: str | None = None) -> str | None:
    """The remote copy of the finished local conversion `local` (a file, or a folder whose `marker` file
    marks it finished), uploaded unless already there; None when the conversions' home is local. Where the
    default home beside the source cannot be written, the conversions of `dataset` stay in the local cache
    from then on (`converted_locally`; None); a `storage.converted` that cannot be written is an error."""
    target, home = remote_path(dataset, local), remote_home(dataset)
    if target is None or home is None:
        return None
    base, _ = home
    done = f"{target}/{marker}" if marker else target
    try:
        if base.exists(done):
            return target
        base.makedirs(target if marker else target.rsplit("/", 1)[0], exist_ok=True)
        if local.is_dir():
            for path in sorted(p for p in local.iterdir() if p.name != marker) + ([local / marker] if marker else []):
                base.put_file(str(path), f"{target}/{path.name}")
        else:
            base.put_file(str(local), target)
    except Exception as exc:  # noqa: BLE001 - each filesystem fails a refused write its own way (aiohttp, botocore)
        refused(dataset, base, target, exc)
        return None
    return target


def refused(dataset: Dataset, base: fsspec.AbstractFileSystem, target: str, exc: Exception) -> None:
    """A write to the conversions' remote home refused: where that home is the default beside the source, the
    conversions of `dataset` stay in the local cache from then on (`dataset.converted` None, a warning); a
    `storage.converted` that cannot be written is an error."""
    reason = redact(str(exc)).splitlines()[0] if str(exc) else "read-only"
    where = redact(base.unstrip_protocol(target))
    if dataset.converted == beside_source(str(dataset.root)):  # the default home: the local cache will do
        log.warning("%s: cannot write the converted dataset beside the source (%s: %s); the conversions stay "
                    "in the local cache and are read from the local disk (set storage.converted to a writable "
                    "location on the dataset's storage to read them from there)", where, type(exc).__name__,
                    reason)
        dataset.converted = None
        return
    raise DatasetError(f"{where}: cannot write the converted dataset there ({type(exc).__name__}: {reason}); "
                       "set storage.converted to a writable location on the dataset's storage") from None
