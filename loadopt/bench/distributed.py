"""Where a bench process stands among the ranks: `Ranks` (one process, rank 0 of 1) and, under `torchrun`,
`TorchrunRanks`; `ranks_here` gives the one this process is. The runner (`run_bench`) runs one loop
over both:

    torchrun --nproc-per-node N -m loadopt bench CONFIG [--tune] ...

Under torchrun every rank builds each planned loader for its rank of the world (the shared sample order
gives each rank a disjoint share: every sample once per epoch across ranks), runs it through the same
harness as a single-process bench, and after every step joins an all-reduce: the stand-in for a
data-parallel job's gradient all-reduce, so a rank that waits for data holds every other rank up, as it
would in training (gloo on CPU, nccl on GPU). The time a rank spends in that all-reduce counts neither as
its data wait nor as compute, so it lowers that rank's utilisation.

The all-reduce also carries each rank's status, so that a setting that fails on one rank fails alone, as
in one process: the failing rank keeps joining the all-reduces, flagged, until every rank has left the
run (the others stop at the next step they see the flag), then all ranks share their outcomes; nobody
waits in a collective that a failed rank will never join.

What the bench does once for the machine (the output folder, the plan and its conversions, the `--tune`
search, the ceilings) rank 0 does alone while the others wait (`alone`), and every rank gets its result;
an error there is every rank's. Rank 0 gathers every rank's figures after each run and writes one
results.json: per-rank figures, the aggregate over ranks and the slowest rank (the one that waited longest
for data); after the runs it measures the ceilings again, the stages apart and the decision alone. The
other ranks write nothing. The per-batch timings file holds rank 0's batches. (The ranks' figures:
`add_ranks`; what a rank reports of a run: `RankReport`.)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from loadopt.bench.knobs import MachineLimits
from loadopt.bench.rank_figures import RecordingLoader, add_ranks, aggregate_ranks
from loadopt.bench.rank_report import RankReport, ToldFailure
from loadopt.device import Elapsed, resolve_device
from loadopt.errors import LoadoptError, Terminated
from loadopt.machine import usable_cores
from loadopt.schema.ceilings import Ceilings
from loadopt.schema.documents import ResultsFile
from loadopt.schema.metrics import RepeatMetrics

T = TypeVar("T")


class PeerFailed(Exception):
    """Another rank failed this run: this rank stops it too (the failing rank's report says why)."""


class PeerError(LoadoptError):
    """A user error that another rank met (the bench stops on every rank), with that rank's exit status."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def launched() -> bool:
    """Whether this process is one rank of several started by torchrun (its environment says so)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def launched_rank() -> int:
    """This process's rank under torchrun (from its environment, before any process group), else 0."""
    return int(os.environ["RANK"]) if launched() else 0


class Ranks:
    """One process: rank 0 of 1. Each method is what the bench does at that point under torchrun
    (`TorchrunRanks`); here it does it directly."""

    rank = 0
    world_size = 1
    local_world_size = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def lead(self) -> bool:
        """Rank 0: it writes the results and prints; the others measure."""
        return self.rank == 0

    def first(self, work: Callable[[], T]) -> T:
        """`work` on every rank, rank 0's first (dataset generation lands in the shared cache)."""
        return work()

    def alone(self, work: Callable[[], T]) -> T:
        """`work` on rank 0 only, its result (picklable) handed to every rank."""
        return work()

    def limits(self) -> MachineLimits:
        """What one rank's loader may use of this machine (the tuner's limits)."""
        return MachineLimits.here()

    def decode_workers(self, per_rank: int) -> int:
        """The decode ceiling's worker processes: what every rank on this machine runs at once."""
        return per_rank

    def job_ceilings(self, ceilings: Ceilings) -> Ceilings:
        """The ceilings with the job's demand: every rank's accelerator."""
        return ceilings

    def wrap_loader(self, loader: Any) -> Any:
        return loader

    def step_sync(self, accelerator: Any) -> Any:
        """The accelerator whose every step is followed by the per-step collective."""
        return accelerator

    def start(self) -> None:
        """Every rank starts its run together; raises `PeerFailed` when another failed before it started."""

    def settle(self, label: str, report: RankReport) -> list[RankReport]:
        """This rank's report of one run (its metrics, or its error) -> every rank's, in rank order."""
        return [dataclasses.replace(report, rank=0)]

    def job_metrics(self, reports: list[RankReport]) -> RepeatMetrics:
        """The job's figures of a run from every rank's report (none failed)."""
        return reports[0].figures()

    def run_suffix(self) -> str:
        return ""

    def annotate(self, results: ResultsFile) -> None:
        """Add what the ranks alone know to rank 0's results."""


class TorchrunRanks(Ranks):
    """One rank of a torchrun job (module docstring); the process group is set up by `ranks_here`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        dist = torch.distributed
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        # The status travels on the host (gloo): on CPU in the step's own all-reduce; with nccl the step's
        # all-reduce stays on the device and a host one beside it carries the status.
        on_device = dist.get_backend() != "gloo"
        self._objects = dist.new_group(backend="gloo") if on_device else None
        self._token = torch.zeros(1, device=device) if on_device else None
        self._status = torch.zeros(2)  # [ranks failed, ranks out of the run]
        self._recording: RecordingLoader | None = None
        self._per_rank: dict[str, list[list[RankReport]]] = {}  # per run label: per rank, its repeats' reports

    # -- once for the machine ------------------------------------------------------------------------

    def first(self, work: Callable[[], T]) -> T:
        if self.rank == 0:
            value = self._agreed(work)
            self._agreed(lambda: None)
            return value
        self._agreed(lambda: None)
        return self._agreed(work)

    def alone(self, work: Callable[[], T]) -> T:
        value: Any = None
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                value = work()
            except BaseException as exc:  # noqa: BLE001 - every rank learns of it, then it is raised here
                failure = exc
        # (value, failure told) from rank 0: the broadcast replaces the other ranks' (None, None)
        box: list[tuple[Any, ToldFailure | None]] = [(value, told_of(failure))]
        torch.distributed.broadcast_object_list(box, src=0, group=self._objects)
        value, told = box[0]
        if failure is not None:
            raise failure
        raise_told(told, 0)
        return value

    def _agreed(self, work: Callable[[], T]) -> T:
        """`work` here; then every rank learns whether it failed on any rank (and raises if so)."""
        value: Any = None
        failure: BaseException | None = None
        try:
            value = work()
        except BaseException as exc:  # noqa: BLE001 - every rank learns of it, then it is raised here
            failure = exc
        told: list[ToldFailure | None] = [None] * self.world_size
        torch.distributed.all_gather_object(told, told_of(failure), group=self._objects)
        if failure is not None:
            raise failure
        for rank, failed_there in enumerate(told):
            raise_told(failed_there, rank)
        return value

    def limits(self) -> MachineLimits:
        here = MachineLimits.here()
        share = max(1, self.local_world_size)
        return dataclasses.replace(here, cores=max(1, here.cores // share), shared_bytes=here.shared_bytes // share,
                                   pinned_bytes=here.pinned_bytes // share)

    def decode_workers(self, per_rank: int) -> int:
        return min(usable_cores(), per_rank * self.local_world_size)

    def job_ceilings(self, ceilings: Ceilings) -> Ceilings:
        job: dict[str, int | float] = {"ranks": self.world_size}
        if ceilings.job.demand_samples_per_s:
            job["demand_samples_per_s"] = ceilings.job.demand_samples_per_s * self.world_size
        return ceilings.model_copy(update={"job": ceilings.job.model_copy(update=job)})

    # -- each run --------------------------------------------------------------------------------------

    def wrap_loader(self, loader: Any) -> Any:
        self._recording = RecordingLoader(loader)
        return self._recording

    def step_sync(self, accelerator: Any) -> Any:
        return _StepSync(accelerator, self)

    def start(self) -> None:
        if self._exchange(failed=False, out=False)[0]:
            raise PeerFailed()

    def step(self) -> None:
        if self._exchange(failed=False, out=False)[0]:
            raise PeerFailed()

    def _exchange(self, failed: bool, out: bool) -> tuple[int, int]:
        """One per-step collective: (ranks that failed, ranks out of the run) over the world."""
        if self._token is not None:
            torch.distributed.all_reduce(self._token)
        self._status[0], self._status[1] = float(failed), float(out)
        torch.distributed.all_reduce(self._status, group=self._objects)
        return int(self._status[0]), int(self._status[1])

    def settle(self, label: str, report: RankReport) -> list[RankReport]:
        while self._exchange(failed=report.failed, out=True)[1] < self.world_size:
            pass  # a rank still running (or stopping at its next step) needs this rank in its collective
        mine = dataclasses.replace(report, rank=self.rank, host=os.uname().nodename, device=str(self.device),
                                   delivered=self._recording.record() if self._recording is not None else [])
        self._recording = None
        reports = [mine] * self.world_size  # the gather puts each rank's report in its place
        torch.distributed.all_gather_object(reports, mine, group=self._objects)
        if self.rank == 0 and all(r.metrics is not None for r in reports):
            ranks = self._per_rank.setdefault(label, [[] for _ in range(self.world_size)])
            for entry in reports:
                ranks[entry.rank].append(entry)
        return reports

    def job_metrics(self, reports: list[RankReport]) -> RepeatMetrics:
        return aggregate_ranks([r.figures() for r in reports])

    def run_suffix(self) -> str:
        return f", rank 0 of {self.world_size}"

    def annotate(self, results: ResultsFile) -> None:
        add_ranks(results, self._per_rank, self.world_size, torch.distributed.get_backend())


@contextmanager
def ranks_here(requested_device: str, timeout_s: float) -> Iterator[Ranks]:
    """This process's `Ranks`: under torchrun the process group is set up here (`timeout_s`: how long a rank
    may wait for the others, e.g. while rank 0 tunes alone) and torn down after."""
    if not launched():
        yield Ranks(resolve_device(requested_device))
        return
    device = resolve_device(requested_device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist = torch.distributed
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=dt.timedelta(seconds=timeout_s))
    try:
        yield TorchrunRanks(device)
    finally:
        if started_here:
            dist.destroy_process_group()


def described(failure: BaseException) -> ToldFailure:
    """A failure as every rank can be told of it (plain data: the exception itself may not pickle)."""
    kind = ("interrupt" if isinstance(failure, KeyboardInterrupt) else
            "user" if isinstance(failure, LoadoptError) else "bug")
    return ToldFailure(kind=kind, terminated=isinstance(failure, Terminated),
                       text=str(failure).splitlines()[0] if str(failure) else type(failure).__name__,
                       exception=type(failure).__name__, exit_code=getattr(failure, "exit_code", 1))


def told_of(failure: BaseException | None) -> ToldFailure | None:
    """`described`, or None where nothing failed."""
    return described(failure) if failure is not None else None


def raise_told(told: ToldFailure | None, rank: int) -> None:
    """Raise here what another rank met (`told`)."""
    if told is None:
        return
    if told.kind == "interrupt":
        raise Terminated() if told.terminated else KeyboardInterrupt()
    if told.kind == "user":
        raise PeerError(f"rank {rank}: {told.text}", told.exit_code)
    raise RuntimeError(f"rank {rank} failed: {told.exception}: {told.text}")


class _StepSync:
    """The emulated accelerator's step followed by the per-step collective across ranks."""

    def __init__(self, accelerator: Any, ranks: TorchrunRanks) -> None:
        self.accelerator, self._ranks = accelerator, ranks

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> Elapsed:
        elapsed = self.accelerator.step(inputs, labels)
        self._ranks.step()
        return elapsed

    def drain(self) -> None:
        self.accelerator.drain()
