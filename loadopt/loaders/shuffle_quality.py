"""How well an epoch's order is shuffled, measured on the order itself: what `benchmarks/webscale.py` prints for
loadopt's shuffles and the peers' beside a global permutation (docs/performance/webscale.md).

Two figures, each scaled so that a uniformly random permutation scores about 1 and storage order about 0:
- `neighbour_spread`: the mean distance, in the delivered order, between each sample and the sample stored
  next to it, over its expectation for a random permutation ((n + 1) / 3). A shard-local shuffle keeps
  stored neighbours close (a window apart at most): the figure falls as windows shrink.
- `class_mix`: the mean count of distinct classes in a batch over its expectation when a batch is drawn at
  random from the whole set (the hypergeometric expectation from the class counts). An order that reads a
  class-sorted source (an ImageFolder) a few shards at a time fills batches with a few classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ShuffleQuality:
    samples: int
    neighbour_spread: float  # ~1: a random permutation; ~0: storage order
    class_mix: float  # distinct classes per batch over a random batch's expectation (~1: random)
    classes_per_batch: float  # the measured mean


def _expected_distinct(class_counts: np.ndarray, batch: int) -> float:
    """E[distinct classes] in `batch` samples drawn without replacement: sum over classes of
    1 - C(n - c, b) / C(n, b)."""
    n = int(class_counts.sum())
    total = math.lgamma(n + 1) - math.lgamma(n - batch + 1)
    absent = [math.exp(math.lgamma(n - c + 1) - math.lgamma(n - c - batch + 1) - total) if n - c >= batch else 0.0
              for c in class_counts[class_counts > 0].tolist()]
    return float(sum(1.0 - a for a in absent))


def shuffle_quality(order: np.ndarray, labels: np.ndarray, batch_size: int) -> ShuffleQuality:
    """The figures of one epoch's `order` (sample indices as delivered, each at most once) over a dataset whose
    samples have `labels`, cut into batches of `batch_size`."""
    order = np.asarray(order, dtype=np.int64)
    if len(order) < 2 or len(np.unique(order)) != len(order):
        raise ValueError("an order of at least two distinct samples, each once, is needed")
    position = np.full(int(order.max()) + 1, -1, dtype=np.int64)
    position[order] = np.arange(len(order))
    stored = np.sort(order)
    here, after = position[stored[:-1]], position[stored[1:]]
    spread = float(np.abs(after - here).mean()) / ((len(order) + 1) / 3)
    delivered = np.asarray(labels)[order]
    full = len(order) // batch_size * batch_size
    if full == 0:
        raise ValueError(f"{len(order)} samples make no batch of {batch_size}")
    batches = np.sort(delivered[:full].reshape(-1, batch_size), axis=1)
    distinct = float((1 + (np.diff(batches, axis=1) != 0).sum(axis=1)).mean())
    expected = _expected_distinct(np.bincount(delivered), batch_size)
    return ShuffleQuality(len(order), spread, distinct / expected, distinct)
