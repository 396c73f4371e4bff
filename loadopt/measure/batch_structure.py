"""Batches as training code holds them (a tensor, a tuple or list, a dict, a namedtuple, nested): how
many samples one holds, its tensors in order, and the same structure rebuilt around moved tensors."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def count_samples(batch: Any) -> int:
    """Samples in a batch: the first dimension of its (first) tensor; a list of plain values counts
    its items; anything else counts as 1."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            return count_samples(value)
        return 1
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        if hasattr(first, "shape") or isinstance(first, (tuple, list, Mapping)):
            return count_samples(first)
        return len(batch)
    return 1


def tensors_of(batch: Any, out: list[Any]) -> None:
    if hasattr(batch, "is_cuda") and hasattr(batch, "to"):
        out.append(batch)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            tensors_of(value, out)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            tensors_of(value, out)


def rebuilt(batch: Any, moved: Iterator[Any]) -> Any:
    if hasattr(batch, "is_cuda") and hasattr(batch, "to"):
        return next(moved)
    if isinstance(batch, Mapping):
        return type(batch)({key: rebuilt(value, moved) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(rebuilt(value, moved) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(rebuilt(value, moved) for value in batch)
    return batch
