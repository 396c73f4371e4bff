"""A dataset's shards for the sample order: runs of consecutive sample indices that live together.

The shard-window shuffle (`ShardWindows`) permutes shards and shuffles samples only within a window of
them, so a rank reads a few shards at a time instead of the whole dataset at random. A shard is what the
source stores together: a tar file of a WebDataset, a Parquet file, a record file. A source without one (an
ImageFolder, a token corpus, the synthetic set) is cut into blocks of `shard_samples` consecutive samples,
which on an ImageFolder means mostly one class each: the shuffle-quality figures (docs/performance/) show
what a window then mixes.

The table depends on the dataset alone, never on a backend or its conversion, so every backend delivers the
same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_SHARD_SAMPLES = 1024


@dataclass(frozen=True, eq=False)
class ShardTable:
    """`bounds[k]` is the first sample of shard k and `bounds[-1]` the number of samples (int64, increasing)."""

    bounds: np.ndarray

    def __post_init__(self) -> None:
        if len(self.bounds) < 2 or self.bounds[0] != 0 or np.any(np.diff(self.bounds) <= 0):
            raise ValueError("shard bounds must start at 0 and increase (every shard holds a sample)")

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_samples(self) -> int:
        return int(self.bounds[-1])

    def sizes(self) -> np.ndarray:
        return np.diff(self.bounds)

    @classmethod
    def blocks(cls, num_samples: int, shard_samples: int = DEFAULT_SHARD_SAMPLES) -> ShardTable:
        """Blocks of `shard_samples` consecutive samples (the last one shorter)."""
        if num_samples <= 0 or shard_samples <= 0:
            raise ValueError(f"{num_samples} samples in blocks of {shard_samples}: both must be positive")
        return cls(np.append(np.arange(0, num_samples, shard_samples, dtype=np.int64), np.int64(num_samples)))

    @classmethod
    def from_runs(cls, shard_of: np.ndarray) -> ShardTable:
        """One shard per run of equal values of `shard_of` (each sample's file): a file whose samples are not
        consecutive gives one shard per run, so the table is right whatever the index's order."""
        n = len(shard_of)
        if n == 0:
            raise ValueError("a dataset without samples has no shards")
        changes = np.flatnonzero(np.asarray(shard_of[1:]) != np.asarray(shard_of[:-1])) + 1
        return cls(np.concatenate([[0], changes, [n]]).astype(np.int64))


def shard_table(dataset: object, shard_samples: int = DEFAULT_SHARD_SAMPLES) -> ShardTable:
    """The shards of `dataset`: its files where its samples come from files of several samples (WebDataset
    tars: `shard_of`; Parquet and record files: `file_of`), else blocks of `shard_samples`. A dataset that keeps
    its shard table (`shard_bounds`: a WebDataset's index) gives it without its per-sample arrays being read."""
    bounds = getattr(dataset, "shard_bounds", None)
    if isinstance(bounds, np.ndarray) and len(bounds) > 1:
        return ShardTable(np.asarray(bounds, dtype=np.int64))
    for name in ("shard_of", "file_of"):
        runs = getattr(dataset, name, None)
        if isinstance(runs, np.ndarray) and len(runs):
            return ShardTable.from_runs(runs)
    return ShardTable.blocks(len(dataset), shard_samples)  # type: ignore[arg-type]


def source_shard_keys(dataset: object) -> list[str] | None:
    """A key per shard of `shard_table(dataset)` that changes when the file it comes from changes: the file's
    name, size, modification time and ETag as listed (WebDataset tars, Parquet files). None for a dataset that
    keeps no such listing of its files (an ImageFolder's samples are files of their own; tokens; synthetic)."""
    keys = getattr(dataset, "file_keys", None)
    names = getattr(dataset, "shards", None) if hasattr(dataset, "shard_of") else getattr(dataset, "files", None)
    owner = getattr(dataset, "shard_of", None)
    owner = owner if owner is not None else getattr(dataset, "file_of", None)
    if not keys or names is None or owner is None or not len(owner):
        return None
    files = np.asarray(owner)[shard_table(dataset).bounds[:-1]]
    return [f"{names[f].decode()}:{keys[f]}" for f in files.tolist()]
