"""`loadopt tiers` under torchrun: every rank is one emulated accelerator, on as many nodes as the job has.

    torchrun --nnodes N --nproc-per-node K -m loadopt tiers CONFIG --tiers T

One client machine cannot load a parallel file system or an object store the way many nodes do; a
torchrun job spreads the accelerators over its nodes. Rank 0 runs the search (`run_tiers`) as in
one process; for each trial of n accelerators it tells every rank (a broadcast) which tier instance to
read and when, ranks 0..n-1 each play one accelerator on their shard of the shared sample order
(`consumers.consume`, the same consumer as the forked one) while the others wait, and rank 0 gathers
their figures (`gather_object`). Nothing passes between the ranks but `torch.distributed`'s collectives.

An emulated tier's state (its bandwidth clock and concurrency slots: `SharedTierState`) is shared by
the processes of one machine, so ranks on one machine share one emulated tier, as the forked consumers
do; ranks on different machines would each emulate their own. Across machines, point the tier at storage
all nodes reach (a shared path or URL, `base`) with no emulated limits: the measured answer is then the
real storage's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from loadopt.bench.distributed import Ranks, described, raise_told
from loadopt.bench.rank_report import ToldFailure
from loadopt.errors import DatasetError
from loadopt.procurement.consumers import ConsumerFigures, ConsumerSettings, TrialFigures, combine, consume
from loadopt.procurement.tiers_document import TiersRun, TorchrunConsumers
from loadopt.storage.dataset import Dataset

_STOP = "stop"


@dataclass(frozen=True)
class TrialReport:
    """What a rank that played one of a trial's accelerators tells the others."""

    rank: int
    figures: ConsumerFigures | None = None  # its consumer's (`consume`'s), None when it failed
    error: str | None = None  # why its consumer failed (one line): the trial fails
    interrupt: ToldFailure | None = None  # Ctrl-C or SIGTERM here: every rank stops


class RankConsumers:
    """The consumers of one trial played by the job's ranks (rank 0's side; the others run `serve`)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def __call__(self, dataset: Dataset, settings: ConsumerSettings, count: int, warmup_s: float,
                 measure_s: float) -> TrialFigures:
        if count > self.ranks.world_size:
            raise DatasetError(f"{count} accelerators: the torchrun job has only {self.ranks.world_size} ranks")
        reports = _play(self.ranks, _broadcast(self.ranks, ("run", dataset, settings, count, warmup_s, measure_s)))
        played = [r for r in reports if r is not None]
        errors = [f"rank {r.rank}: {r.error}" for r in played if r.error is not None]
        if errors:
            raise DatasetError(f"consumer failed: {errors[0]}")
        nodes = max(1, self.ranks.world_size // max(1, self.ranks.local_world_size))
        return combine([r.figures for r in played if r.figures is not None], count, warmup_s, measure_s,
                       machines=nodes)

    def stop(self) -> None:
        """Release the other ranks from `serve` (rank 0, once its search is over or failed)."""
        _broadcast(self.ranks, (_STOP,))


def serve(ranks: Ranks) -> None:
    """A rank other than 0: play the accelerator rank 0 asks for in each trial, until it says stop."""
    while True:
        command = _broadcast(ranks, None)
        if command[0] == _STOP:
            return
        _play(ranks, command)


def _broadcast(ranks: Ranks, command: Any) -> Any:
    box = [command]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _play(ranks: Ranks, command: Any) -> list[TrialReport | None]:
    """Every rank, with the trial rank 0 broadcast: play it if this rank is one of its accelerators; gather."""
    _, dataset, settings, count, warmup_s, measure_s = command
    torch.distributed.barrier()  # every rank has the trial: the clocks start from here, within milliseconds
    t_start = time.perf_counter() + 0.2
    t_window = t_start + warmup_s
    t_end = t_window + measure_s
    report: TrialReport | None = None  # None: this rank plays no accelerator of this trial
    if ranks.rank < count:
        try:
            report = TrialReport(ranks.rank, figures=consume(dataset, settings, ranks.rank, count, t_start, t_window,
                                                             t_end))
        except Exception as exc:  # noqa: BLE001 - told to rank 0 as one line, as the forked consumers do
            report = TrialReport(ranks.rank, error=described(exc).text)
        except BaseException as exc:  # Ctrl-C / SIGTERM: every rank learns of it after the gather
            report = TrialReport(ranks.rank, interrupt=described(exc))
    gathered: list[TrialReport | None] = [None] * ranks.world_size
    torch.distributed.all_gather_object(gathered, report)
    for entry in gathered:
        if entry is not None:
            raise_told(entry.interrupt, entry.rank)
    return gathered


def run_tiers_here(config: Any, tiers: list[Any], **options: Any) -> TiersRun | None:
    """`procurement.run_tiers` as this process takes part in it: alone (forked consumers), or as one rank of
    a torchrun job (rank 0 searches and returns the result; the other ranks serve and return None)."""
    from loadopt.bench.distributed import ranks_here
    from loadopt.procurement.run import run_tiers

    # How long a rank may wait in a collective: the longest trial, rank 0's probing or the whole search.
    timeout_s = 3600.0 + options.get("budget_s", 300.0) * len(tiers)
    with ranks_here("cpu", timeout_s) as ranks:
        if ranks.world_size == 1:
            return run_tiers(config, tiers, **options)
        if not ranks.lead:
            serve(ranks)
            return None
        played = RankConsumers(ranks)
        try:
            # Every backend through each tier is a one-process bench: not run under torchrun.
            result = run_tiers(config, tiers, **{**options, "backends_out": None}, consumers=played,
                               ranks=ranks.world_size)
        finally:
            played.stop()
        nodes = max(1, ranks.world_size // max(1, ranks.local_world_size))
        result.consumer.torchrun = TorchrunConsumers(ranks=ranks.world_size, nodes=nodes,
                                                     note="each rank one emulated accelerator (procurement/ranks.py)")
        return result
