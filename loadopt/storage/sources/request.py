"""What a source's opener is handed: the config, the split, and where the dataset is, the tier not yet applied."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from loadopt.config_models import Config

# (a filesystem over the source, its fingerprint) -> the filesystem to index it through
IndexThrough = Callable[[fsspec.AbstractFileSystem, str], fsspec.AbstractFileSystem]


@dataclass(frozen=True)
class SourceRequest:
    """A dataset to open: `path` is its location (the tier's `base` joined on), None for a dataset generated into
    the cache; `relist` lists it again instead of reading its saved listing (`--relist`)."""

    config: Config
    split: str
    path: str | None
    storage_options: dict[str, Any] | None = None
    progress: Callable[[int, int], None] | None = None
    relist: bool = False
    index_through: IndexThrough | None = None  # tar shards indexed through the shard cache (storage.cache_limit)
