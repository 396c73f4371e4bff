"""The figures of a results file's runs: one figure, its spread over the repeats, a repeat's and a run's
metrics, and a torchrun bench's per-rank figures (`Run` and `ResultsFile` hold them)."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

# One figure of a run: a rate, a fraction, a count, a flag (h2d_pinned), a note (measure's compute_source),
# or None where it was not measured.
Figure = float | int | bool | str | None


class Spread(TypedDict):
    """One metric over the repeats of a setting (an integer metric, samples or batches, keeps its ints)."""

    median: float | int
    min: NotRequired[float | int]  # a file written by hand or another tool may hold only the median
    max: NotRequired[float | int]


RepeatMetrics = dict[str, Figure]  # the flat metrics of one repeat (loadopt.bench.metrics.step_metrics)
RunMetrics = dict[str, Spread | Figure]  # per metric its Spread over the repeats, or the one value

# The accelerator's busy and idle shares: no figures of a run that had no step to be busy with (`took_no_step`).
IDLE_FIGURES = ("accelerator_utilisation", "stall_fraction", "loader_stall_fraction", "finish_stall_fraction")


def took_no_step(metrics: RunMetrics | RepeatMetrics) -> bool:
    """Whether the run had no step (`workload.step_time_ms: 0` on the emulated accelerator): it took batches as
    fast as they came, so its rate is the input path's alone and its "stall" (100%) says nothing."""
    compute = metrics.get("compute_s")
    if isinstance(compute, dict):
        compute = compute.get("median")
    return isinstance(compute, int | float) and not isinstance(compute, bool) and compute == 0


class DeliveredEpoch(TypedDict):
    """Which samples a rank delivered in one epoch (results.json `runs[].ranks[].delivered`)."""

    epoch: int
    samples: int
    complete: bool  # every sample of the rank's share of that epoch
    digest: str  # order-free digest of the indices (bench/rank_figures.indices_digest)


class RankFigures(TypedDict):
    """One rank's figures of a run, per repeat (results.json `runs[].ranks[]`, a torchrun bench)."""

    rank: int
    host: str
    device: str
    metrics: list[RepeatMetrics]
    delivered: list[list[DeliveredEpoch]]


class SlowestRank(TypedDict):
    """The rank that waited longest for data (results.json `runs[].slowest_rank`), medians over repeats."""

    rank: int
    wait_s: float
    samples_per_s: float
    accelerator_utilisation: float


class DistributedNote(TypedDict):
    """How a torchrun bench ran and what its figures mean (results.json `distributed`)."""

    world_size: int
    backend: str
    step_sync: str
    aggregate: str
    timings: str
    alone: str
    slowest_ranks: list[str]  # per run: which rank was slowest, how long it waited
