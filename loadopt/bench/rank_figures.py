"""The figures of a torchrun bench's ranks: which samples each rank delivered, the job's metrics from its
ranks', the slowest rank, and what results.json says of the ranks (bench/distributed.py runs them)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from loadopt.bench.metrics import median

# Summed over ranks (extensive), the worst over ranks, or the mean over ranks; the rates are recomputed.
_SUMMED = ("samples", "compute_s", "wait_s", "h2d_s", "finish_s", "sample_bytes_delivered", "bytes_read",
           "storage_bytes_read", "cpu_seconds", "peak_rss_mb", "peak_pss_mb")
_WORST = ("wall_s", "batches", "wait_p50_ms", "wait_p95_ms", "wait_p99_ms", "wait_max_ms")
_MEAN = ("accelerator_utilisation", "h2d_gb_per_s", "device_idle_fraction", "loader_stall_fraction",
         "finish_stall_fraction")


class RecordingLoader:
    """A loader that remembers which samples it delivered in which epoch (for the per-rank record)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self.delivered: dict[int, list[np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def host_batches(self) -> Iterator[Any]:
        for batch in self._loader.host_batches():
            self.delivered.setdefault(self._loader.epoch, []).append(np.asarray(batch.indices, dtype=np.int64))
            yield batch

    def record(self) -> list[dict[str, Any]]:
        """Per epoch: how many samples, an order-free digest of which, and whether the epoch was complete."""
        out = []
        per_epoch = len(self._loader.order().indices())
        for epoch, batches in sorted(self.delivered.items()):
            indices = np.sort(np.concatenate(batches))
            out.append({"epoch": epoch, "samples": len(indices), "complete": len(indices) == per_epoch,
                        "digest": indices_digest(indices)})
        return out


def indices_digest(indices: np.ndarray) -> str:
    """A digest of a set of sample indices (sorted first, so the order does not matter)."""
    return hashlib.sha256(np.sort(np.asarray(indices, dtype=np.int64)).tobytes()).hexdigest()[:16]


def aggregate_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures from its ranks': totals, the worst wait percentiles, the mean utilisation."""
    first = per_rank[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [m[key] for m in per_rank if m.get(key) is not None]
        if key in _SUMMED and values:
            out[key] = sum(values)
        elif key in _WORST and values:
            out[key] = max(values)
        elif key in _MEAN and values:
            out[key] = sum(values) / len(values)
        else:
            out[key] = value
    wall = out["wall_s"]
    out["samples_per_s"] = out["samples"] / wall if wall > 0 else 0.0
    out["mb_per_s"] = out["sample_bytes_delivered"] / wall / 1e6 if wall > 0 else 0.0
    if "tokens_per_s" in first:
        out["tokens_per_s"] = sum(m["tokens_per_s"] for m in per_rank)
    out["stall_fraction"] = 1.0 - out["accelerator_utilisation"]
    out["goodput_ratio"] = out["sample_bytes_delivered"] / out["bytes_read"] if out["bytes_read"] else None
    out["cpu_seconds_per_1k_samples"] = out["cpu_seconds"] / out["samples"] * 1000.0 if out["samples"] else None
    return out


def slowest_rank(per_rank_repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The rank that waited longest for data (median over repeats): the one the others waited for."""
    waits = [float(np.median([r["metrics"]["wait_s"] for r in repeats])) for repeats in per_rank_repeats]
    rank = int(np.argmax(waits))
    rates = [float(np.median([r["metrics"]["samples_per_s"] for r in per_rank_repeats[rank]]))]
    return {"rank": rank, "wait_s": waits[rank], "samples_per_s": rates[0],
            "accelerator_utilisation": float(np.median([r["metrics"]["accelerator_utilisation"]
                                                        for r in per_rank_repeats[rank]]))}


def add_ranks(results: dict[str, Any], per_rank: dict[str, list[list[dict[str, Any]]]], world: int,
               backend: str) -> None:
    results["command"] = f"torchrun --nproc-per-node {world} -m loadopt bench"
    results["distributed"] = {
        "world_size": world, "backend": backend,
        "step_sync": "an all-reduce after every step (stand-in for the gradient all-reduce; it also carries "
                     "each rank's status, so that a setting failing on one rank fails alone)",
        "aggregate": "samples/s and MB/s: all ranks' samples over the longest rank's window; utilisation: the "
                     "mean over ranks; wait percentiles: the worst rank's; CPU, memory, bytes: summed",
        "timings": "timings.parquet holds rank 0's batches",
        "alone": "rank 0 alone, the other ranks waiting: the plan and its conversions, the --tune search (each "
                 "setting within one rank's share of the machine), the ceilings (the decode ceiling with every "
                 "rank's worker processes on this machine; the job's demand: every rank's accelerator) and the "
                 "stages apart (one loader over the whole dataset against one accelerator's demand)",
    }
    slowest_text = []
    for run in results["runs"]:
        ranks = per_rank.get(run["label"])
        if not ranks or "metrics" not in run:
            continue
        run["ranks"] = [{"rank": r, "host": repeats[0]["host"], "device": repeats[0]["device"],
                         "metrics": [x["metrics"] for x in repeats], "delivered": [x["delivered"] for x in repeats]}
                        for r, repeats in enumerate(ranks)]
        run["slowest_rank"] = slowest_rank(ranks)
        slow = run["slowest_rank"]
        slowest_text.append(f"{run['label']}: rank {slow['rank']} (waited {slow['wait_s']:.2f} s for data, "
                            f"AU {slow['accelerator_utilisation']:.0%})")
    if results["ranking"]:
        best = next(r for r in results["runs"] if r["label"] == results["ranking"][0])
        rate = median(best["metrics"], "samples_per_s")
        results["summary"] = (f"fastest on {world} ranks: {best['label']} at {rate:,.0f} samples/s in all; "
                              f"slowest rank {best['slowest_rank']['rank']}")
    results["distributed"]["slowest_ranks"] = slowest_text
