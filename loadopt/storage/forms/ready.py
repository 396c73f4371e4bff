"""The one sequence every converting backend's `prepare` runs: a conversion made ready to open (its reference
fetched from its remote home, converted where missing), then, once opened, where its shards are read from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from loadopt.errors import DatasetError
from loadopt.storage.dataset import Dataset
from loadopt.storage.forms import placement, shard_work
from loadopt.storage.remote import converted as remote_shards

KINDS = {"arrow": "Arrow", "raw": "raw"}  # `loadopt convert --to` -> how a message names the conversion


def make_ready(dataset: Dataset, path: Path, reference_names: Callable[[dict[str, Any]], list[str]],
               convert: Callable[[], object] | None, to: str, form: str, flags: str = "") -> None:
    """The conversion at `path` (in the local cache) ready to open: a reference finished on the remote home
    fetched first (converted elsewhere), then `convert()`, which returns at once where it is finished (and
    makes it again where `storage.converted` moved since). `convert` None: a missing conversion is the one-line
    error naming the command that makes it (`loadopt convert CONFIG --to TO FLAGS`)."""
    remote_shards.fetch_reference(dataset, path, reference_names)
    if convert is not None:
        convert()
    elif not (path / shard_work.MANIFEST).exists():
        raise DatasetError(f"{path}: no {KINDS[to]} conversion of {dataset.root} ({form}); run "
                           f"`loadopt convert CONFIG --to {to}{flags}`")


@dataclass(frozen=True)
class ReadFrom:
    """Where an opened conversion's shards are read: through `tier` at `folder` (a remote home, or the local
    folder under an emulated tier), or, `tier` None, the local files directly (the fast paths)."""

    tier: fsspec.AbstractFileSystem | None
    folder: str

    def paths(self, names: list[str]) -> list[str]:
        return [f"{self.folder}/{name}" for name in names]


def read_from(dataset: Dataset, path: Path) -> ReadFrom:
    """The finished conversion at `path` published to its remote home (uploaded unless there), then where its
    shards are read. The tier is asked after the upload: one refused just now keeps the conversion in the local
    cache, read directly."""
    remote = placement.publish(dataset, path, marker=shard_work.MANIFEST)
    return ReadFrom(placement.conversion_tier(dataset), remote or str(path))
