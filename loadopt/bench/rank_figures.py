"""The figures of a torchrun bench's ranks: which samples each rank delivered, the job's metrics from its
ranks', the slowest rank, and what results.json says of the ranks (`TorchrunRanks` runs them; each
rank's report of a run: `RankReport`)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from loadopt.bench.metrics import median
from loadopt.bench.rank_report import RankReport
from loadopt.schema.documents import ResultsFile
from loadopt.schema.metrics import DeliveredEpoch, DistributedNote, RankFigures, RepeatMetrics, SlowestRank

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

    def record(self) -> list[DeliveredEpoch]:
        """Per epoch: how many samples, an order-free digest of which, and whether the epoch was complete."""
        out = []
        per_epoch = len(self._loader.order().indices())
        for epoch, batches in sorted(self.delivered.items()):
            indices = np.sort(np.concatenate(batches))
            out.append(DeliveredEpoch(epoch=epoch, samples=len(indices), complete=len(indices) == per_epoch,
                                      digest=indices_digest(indices)))
        return out


def indices_digest(indices: np.ndarray) -> str:
    """A digest of a set of sample indices (sorted first, so the order does not matter)."""
    return hashlib.sha256(np.sort(np.asarray(indices, dtype=np.int64)).tobytes()).hexdigest()[:16]


def _number(metrics: RepeatMetrics, key: str) -> float | None:
    """A numeric figure as recorded (a numpy scalar stays one), None where it was not measured."""
    value = metrics.get(key)
    return None if value is None or isinstance(value, str) else value


def _figure(metrics: RepeatMetrics, key: str) -> float:
    """A figure every rank's window metrics hold (bench.metrics.window_metrics)."""
    value = _number(metrics, key)
    if value is None:
        raise KeyError(f"no {key!r} in a rank's metrics")
    return value


def aggregate_ranks(per_rank: list[RepeatMetrics]) -> RepeatMetrics:
    """The job's figures from its ranks': totals, the worst wait percentiles, the mean utilisation."""
    first = per_rank[0]
    out: RepeatMetrics = {}
    for key, value in first.items():
        values = [v for m in per_rank if (v := _number(m, key)) is not None]
        if key in _SUMMED and values:
            out[key] = sum(values)
        elif key in _WORST and values:
            out[key] = max(values)
        elif key in _MEAN and values:
            out[key] = sum(values) / len(values)
        else:
            out[key] = value
    wall, samples, delivered = _figure(out, "wall_s"), _figure(out, "samples"), _figure(out, "sample_bytes_delivered")
    bytes_read = _number(out, "bytes_read")
    out["samples_per_s"] = samples / wall if wall > 0 else 0.0
    out["mb_per_s"] = delivered / wall / 1e6 if wall > 0 else 0.0
    if "tokens_per_s" in first:
        out["tokens_per_s"] = sum(_figure(m, "tokens_per_s") for m in per_rank)
    out["stall_fraction"] = 1.0 - _figure(out, "accelerator_utilisation")
    out["goodput_ratio"] = delivered / bytes_read if bytes_read else None
    out["cpu_seconds_per_1k_samples"] = _figure(out, "cpu_seconds") / samples * 1000.0 if samples else None
    return out


def slowest_rank(per_rank_repeats: list[list[RankReport]]) -> SlowestRank:
    """The rank that waited longest for data (median over repeats): the one the others waited for."""
    def over_repeats(repeats: list[RankReport], key: str) -> float:
        return float(np.median([_figure(r.figures(), key) for r in repeats]))

    waits = [over_repeats(repeats, "wait_s") for repeats in per_rank_repeats]
    rank = int(np.argmax(waits))
    slowest = per_rank_repeats[rank]
    return SlowestRank(rank=rank, wait_s=waits[rank], samples_per_s=over_repeats(slowest, "samples_per_s"),
                       accelerator_utilisation=over_repeats(slowest, "accelerator_utilisation"))


def rank_figures(rank: int, repeats: list[RankReport]) -> RankFigures:
    return RankFigures(rank=rank, host=repeats[0].host, device=repeats[0].device,
                       metrics=[r.figures() for r in repeats], delivered=[r.delivered for r in repeats])


def add_ranks(results: ResultsFile, per_rank: dict[str, list[list[RankReport]]], world: int, backend: str) -> None:
    """Into a bench's results (rank 0's): the command, how the ranks ran, and per run its ranks' figures."""
    results.command = f"torchrun --nproc-per-node {world} -m loadopt bench"
    note = DistributedNote(
        world_size=world, backend=backend,
        step_sync="an all-reduce after every step (stand-in for the gradient all-reduce; it also carries "
                  "each rank's status, so that a setting failing on one rank fails alone)",
        aggregate="samples/s and MB/s: all ranks' samples over the longest rank's window; utilisation: the "
                  "mean over ranks; wait percentiles: the worst rank's; CPU, memory, bytes: summed",
        timings="timings.parquet holds rank 0's batches",
        alone="rank 0 alone, the other ranks waiting: the plan and its conversions, the --tune search (each "
              "setting within one rank's share of the machine), the ceilings (the decode ceiling with every "
              "rank's worker processes on this machine; the job's demand: every rank's accelerator) and the "
              "stages apart (one loader over the whole dataset against one accelerator's demand)",
        slowest_ranks=[])
    results.distributed = note
    for run in results.runs:
        ranks = per_rank.get(run.label)
        if not ranks or run.metrics is None:
            continue
        run.ranks = [rank_figures(r, repeats) for r, repeats in enumerate(ranks)]
        slow = run.slowest_rank = slowest_rank(ranks)
        note["slowest_ranks"].append(f"{run.label}: rank {slow['rank']} (waited {slow['wait_s']:.2f} s for "
                                     f"data, AU {slow['accelerator_utilisation']:.0%})")
    best = results.measured()[0] if results.ranking else None
    if best is not None and best.slowest_rank is not None:  # every measured run has its ranks' figures
        rate = median(best.metrics or {}, "samples_per_s")
        results.summary = (f"fastest on {world} ranks: {best.label} at {rate:,.0f} samples/s in all; "
                           f"slowest rank {best.slowest_rank['rank']}")
