"""The shared per-epoch sample order: every backend draws its batches from here.

The order depends only on (num_samples, seed, epoch, shuffle, rank, world_size, batch_size, drop_last) and,
for the shard-window shuffle, the dataset's shard table, so two backends given the same seed deliver the same
samples in the same batches, and a switch of backend changes nothing but speed. Worker counts play no part:
a run resumed with other workers continues the same order.

Shuffles (`pipeline.shuffle`):
- `global`: one permutation of every sample per epoch; rank r takes every world_size-th of it from r.
- `window`: the shards (`shard_table`) permuted per epoch, their samples laid end to end and cut into
  world_size contiguous shares, so a rank reads about shards/world_size of them; its share is shuffled within
  windows of `window_shards` shards. A rank holds its own share only, never the dataset's order.
- `none`: the samples in order, strided over ranks as `global`.

Every rank gets the same number of batches, so no collective of a distributed step can wait for a rank that
ran out (ranks' shares differ by at most one sample, which can leave one rank a batch short):
- `drop_last`: every rank takes (num_samples // world_size) // batch_size full batches; a sample of the
  tail beyond them is not seen this epoch (fewer than world_size x batch_size + world_size of them).
- otherwise: every rank takes ceil(ceil(num_samples / world_size) / batch_size) batches; a rank a batch
  short appends one sample of its own share again (its first), so at most world_size - 1 samples are seen
  twice in an epoch, each counted in `padding()`. With one rank nothing is ever repeated or dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, overload

import numpy as np

from loadopt.storage.sources.shards import ShardTable

Shuffle = Literal["global", "window", "none"]
SHUFFLES: tuple[Shuffle, ...] = ("global", "window", "none")
DEFAULT_WINDOW_SHARDS = 16

# Stream ids of the window shuffle's generators: apart from `epoch_permutation`'s (seed, epoch).
_SHARD_STREAM, _WINDOW_STREAM = 1, 2


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """All sample indices of one epoch, in the order shared by every rank and backend."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    # The same permutation as rng.permutation(num_samples) (one shuffle, the same draws), on 32-bit indices
    # where they fit: half the memory its random swaps touch, linear in the samples past the CPU's caches
    # (measured: 1.2 ms at 100k, 11 ms at 1M; 64-bit: 0.8 and 12 ms, a fitted exponent of 1.15).
    order = np.arange(num_samples, dtype=np.int32 if num_samples < 2**31 else np.int64)
    rng.shuffle(order)
    return order.astype(np.int64)


@dataclass(frozen=True, eq=False)
class ShardWindows:
    """What the window shuffle needs of the dataset: its shards and how many make a window."""

    table: ShardTable
    window_shards: int = DEFAULT_WINDOW_SHARDS

    def __post_init__(self) -> None:
        if self.window_shards < 1:
            raise ValueError(f"window_shards must be at least 1, got {self.window_shards}")


@dataclass(frozen=True)
class RankShards:
    """The shards a rank reads in one epoch under the window shuffle, in the order it reads them, and the
    part of each: samples `first[i]` to `last[i]` (exclusive) of shard `shards[i]`, counted from its start."""

    shards: np.ndarray
    first: np.ndarray
    last: np.ndarray


class Batches(Sequence[np.ndarray]):
    """An epoch's batches from batch `start` on: views of the rank's indices made when asked for, so a rank of
    a large epoch holds its indices and not also an array object per batch (+22% at batches of 64)."""

    def __init__(self, indices: np.ndarray, batch_size: int, start: int = 0) -> None:
        self._indices, self._size = indices, batch_size
        self._first = start * batch_size
        self._count = max(0, -(-(len(indices) - self._first) // batch_size))

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, k: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, k: slice) -> list[np.ndarray]: ...
    def __getitem__(self, k: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._count))]
        if k < 0:
            k += self._count
        if not 0 <= k < self._count:
            raise IndexError(f"batch {k} of {self._count}")
        at = self._first + k * self._size
        return self._indices[at : at + self._size]


@dataclass(frozen=True)
class EpochOrder:
    """The batches of sample indices one rank iterates in one epoch."""

    num_samples: int
    batch_size: int
    seed: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1
    shuffle: Shuffle | bool = "global"  # True: global, False: none (the older boolean spelling)
    drop_last: bool = False
    windows: ShardWindows | None = None  # the window shuffle's shards (required by it, ignored otherwise)

    def __post_init__(self) -> None:
        if isinstance(self.shuffle, bool):
            object.__setattr__(self, "shuffle", "global" if self.shuffle else "none")
        if self.shuffle not in SHUFFLES:
            raise ValueError(f"shuffle {self.shuffle!r}: unknown (known: {', '.join(SHUFFLES)})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.shuffle == "window":
            if self.windows is None:
                raise ValueError("the window shuffle needs the dataset's shards (windows=ShardWindows(...))")
            if self.windows.table.num_samples != self.num_samples:
                raise ValueError(f"the shard table holds {self.windows.table.num_samples} samples, the order "
                                 f"{self.num_samples}")

    def __len__(self) -> int:
        """Batches per epoch: the same on every rank (the module's rule)."""
        if self.drop_last:
            return (self.num_samples // self.world_size) // self.batch_size
        longest = -(-self.num_samples // self.world_size)  # ceil: the longest share
        return -(-longest // self.batch_size)

    def share(self) -> np.ndarray:
        """This rank's samples for the epoch, in order, before the equal-batches rule."""
        if self.shuffle == "window":
            return self._window_share()
        # a copy: a strided view would keep the whole epoch's permutation alive for as long as the batches
        return epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle == "global")[
            self.rank :: self.world_size].copy()

    def indices(self) -> np.ndarray:
        """This rank's sample indices for the epoch, in order: its share cut or padded to `len(self)` batches."""
        mine = self.share()
        wanted = len(self) * self.batch_size
        if self.drop_last or len(mine) > wanted - self.batch_size:
            return mine[:wanted]
        # A batch short (the share a multiple of batch_size, one sample below the longest): one sample again.
        return np.append(mine, mine[0] if len(mine) else self._first_sample())

    def padding(self) -> int:
        """Samples this rank delivers twice this epoch (0 or 1; always 0 on one rank or with drop_last)."""
        return max(0, len(self.indices()) - len(self.share()))

    def batches(self, start: int = 0) -> Batches:
        """The batches from batch `start` on (resumption skips the first `start` batches)."""
        return Batches(self.indices(), self.batch_size, start)

    # -- the window shuffle ----------------------------------------------------------------------

    def rank_shards(self) -> RankShards:
        """The shards this rank reads this epoch and which part of each (the window shuffle only): what a
        per-rank index needs to load, nothing else."""
        if self.shuffle != "window" or self.windows is None:
            raise ValueError("only the window shuffle deals shards to ranks")
        permuted, starts, ends = self._shard_layout()
        lo = self.num_samples * self.rank // self.world_size
        hi = self.num_samples * (self.rank + 1) // self.world_size
        take = slice(int(np.searchsorted(ends, lo, side="right")), int(np.searchsorted(starts, hi, side="left")))
        first, last = np.maximum(lo, starts[take]) - starts[take], np.minimum(hi, ends[take]) - starts[take]
        some = last > first  # an empty share (fewer samples than ranks) touches no shard
        return RankShards(permuted[take][some], first[some], last[some])

    def _shard_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The epoch's shard permutation and where each permuted shard starts and ends once laid end to end."""
        assert self.windows is not None  # checked in __post_init__
        table = self.windows.table
        rng = np.random.Generator(np.random.PCG64([self.seed, self.epoch, _SHARD_STREAM]))
        permuted = rng.permutation(table.num_shards)
        ends = np.cumsum(table.sizes()[permuted])
        return permuted, ends - table.sizes()[permuted], ends

    def _window_share(self) -> np.ndarray:
        assert self.windows is not None  # checked in __post_init__
        bounds, size = self.windows.table.bounds, self.windows.window_shards
        part = self.rank_shards()
        out = np.empty(int((part.last - part.first).sum()), dtype=np.int64)
        at = 0
        for window, begin in enumerate(range(0, len(part.shards), size)):
            start = at
            for shard, first, last in zip(part.shards[begin : begin + size].tolist(),
                                          part.first[begin : begin + size].tolist(),
                                          part.last[begin : begin + size].tolist(), strict=True):
                out[at : at + last - first] = np.arange(bounds[shard] + first, bounds[shard] + last)
                at += last - first
            rng = np.random.Generator(np.random.PCG64([self.seed, self.epoch, _WINDOW_STREAM, self.rank, window]))
            rng.shuffle(out[start:at])
        return out

    def _first_sample(self) -> np.int64:
        """A sample for a rank whose share is empty (fewer samples than ranks): one of another rank's."""
        position = self.rank % self.num_samples
        if self.shuffle == "window":
            assert self.windows is not None
            permuted, starts, ends = self._shard_layout()
            j = int(np.searchsorted(ends, position, side="right"))
            return np.int64(self.windows.table.bounds[permuted[j]] + position - starts[j])
        return epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle == "global")[position]


class Ordered(Protocol):
    """What a `LoaderSampler` asks of its loader (`loaders.base.Loader` answers it)."""

    def set_epoch(self, epoch: int) -> None: ...

    def order(self) -> EpochOrder: ...


class LoaderSampler:
    """A loader's order in a DataLoader's `sampler` shape: `set_epoch(epoch)` starts that epoch (what Lightning's
    loops and Accelerate call on `loader.sampler`), iterating gives this rank's sample indices of the epoch."""

    def __init__(self, loader: Ordered) -> None:
        self.loader = loader

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        for batch in self.loader.order().batches(0):
            yield from batch.tolist()

    def __len__(self) -> int:
        return sum(len(batch) for batch in self.loader.order().batches(0))
