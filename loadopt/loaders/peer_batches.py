"""A peer library's batch stream as loadopt's batches: the library's samples collated into dicts
(`collate`), and those dicts cut into the batch sizes the base class planned (`rebatch`), copying only what
is kept past the library's next batch (`owned`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from loadopt.loaders.base import HostBatch, Layout


def collate(samples: list[tuple]) -> dict[str, Any]:
    """A batch of `CropSample` results: uint8 NHWC inputs, labels, indices, and the samples that failed.
    (A library that delivers another layout says so under "layout"; one whose inputs are a
    view of a buffer it reuses at its next batch sets "borrowed", as FFCV's.)"""
    good = [s for s in samples if s[3] is None]
    size = good[0][0].shape[0] if good else 0
    inputs = torch.stack([s[0] for s in good]) if good else torch.empty((0, size, size, 3), dtype=torch.uint8)
    return {"inputs": inputs, "layout": "NHWC", "labels": torch.tensor([s[1] for s in good], dtype=torch.int64),
            "indices": torch.tensor([s[2] for s in good], dtype=torch.int64),
            "failures": [(int(s[2]), s[3]) for s in samples if s[3] is not None]}


# ---------------------------------------------------------------------------------------------
# In the consumer


def owned(part: dict[str, Any]) -> dict[str, Any]:
    """`part` with its pixels in memory of its own: a copy of a borrowed part's (a view of a buffer the
    library reuses when its next batch is asked for), the part itself otherwise."""
    if not part.get("borrowed"):
        return part
    return {**part, "inputs": part["inputs"].clone(), "borrowed": False}


def rebatch(stream: Iterator[dict[str, Any]], sizes: list[int], skip: int = 0) -> Iterator[HostBatch]:
    """Cut the library's batches (`collate`'s dicts) into batches of `sizes` samples (failed ones count),
    after dropping the first `skip` samples (a resumed epoch). A batch that already has the size passes
    through uncopied (a `borrowed` one as a borrowed HostBatch: finished before the next is asked for); what
    is kept of a borrowed one past a yield is copied before the library's next batch is asked for; the
    stream ending early ends the last batch short."""
    parts: list[dict[str, Any]] = []
    have = 0
    layout: Layout = "NCHW"

    def take(count: int) -> HostBatch:
        nonlocal have
        chosen, failures, left = [], [], count
        while left and parts:
            part = parts[0]
            part_failures = part["failures"]
            n = len(part["indices"]) + len(part_failures)
            if n <= left:
                chosen.append(part)
                failures += part_failures
                parts.pop(0)
                left -= n
                continue
            good = max(0, left - len(part_failures))  # the part's failures go with its first samples
            failures += part_failures[:left]
            borrowed = part.get("borrowed", False)
            chosen.append({**{k: part[k][:good] for k in ("inputs", "labels", "indices")}, "borrowed": borrowed})
            parts[0] = {**{k: part[k][good:] for k in ("inputs", "labels", "indices")},
                        "failures": part_failures[left:], "borrowed": borrowed}
            left = 0
        have -= count - left
        borrowed = False
        if len(chosen) == 1:
            inputs, labels, indices = chosen[0]["inputs"], chosen[0]["labels"], chosen[0]["indices"]
            borrowed = bool(chosen[0].get("borrowed", False))
        else:
            inputs = torch.cat([c["inputs"] for c in chosen])
            labels = torch.cat([c["labels"] for c in chosen])
            indices = torch.cat([c["indices"] for c in chosen])
        return HostBatch(inputs, labels, np.asarray(indices, np.int64), layout, normalised=False, failures=failures,
                         borrowed=borrowed)

    sizes = list(sizes)
    for part in stream:
        layout = part.get("layout", "NCHW")
        parts.append(part)
        have += len(part["indices"]) + len(part["failures"])
        if skip:
            dropped = min(skip, have)
            take(dropped)
            skip -= dropped
        while sizes and have >= sizes[0]:
            yield take(sizes.pop(0))
        if not sizes:
            return
        parts = [owned(p) for p in parts]  # before the library's next batch reuses a borrowed buffer
    if sizes and have:
        yield take(have)
