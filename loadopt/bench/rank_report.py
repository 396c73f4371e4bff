"""What the ranks of a torchrun bench tell each other of one run (`TorchrunRanks` carries it): a rank's
`RankReport` (with the samples it delivered per epoch: the schema's `DeliveredEpoch`), and a failure as
plain data (`ToldFailure`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadopt.schema.metrics import DeliveredEpoch, RepeatMetrics


@dataclass(frozen=True)
class ToldFailure:
    """A failure as every rank can be told of it: plain data, since the exception itself may not pickle."""

    kind: str  # "interrupt" (Ctrl-C, SIGTERM), "user" (a LoadoptError) or "bug"
    terminated: bool  # an interrupt by SIGTERM (errors.Terminated)
    text: str  # the first line of its message (else its type's name)
    exception: str  # its type's name
    exit_code: int


@dataclass
class RankReport:
    """One rank's outcome of one run, built by the runner; `Ranks.settle` adds where it ran and hands every
    rank everyone's."""

    metrics: RepeatMetrics | None = None  # None: it failed, or stopped because another rank failed
    skipped: list[tuple[str, str]] = field(default_factory=list)  # samples the loader skipped, with why
    tier: dict[str, float] | None = None  # what the run added to the storage tier's counters
    error: str | None = None  # this setting failed here (one line): the bench goes on
    fatal: ToldFailure | None = None  # a user error here: the bench stops, on every rank
    rank: int = 0
    host: str = ""
    device: str = ""
    delivered: list[DeliveredEpoch] = field(default_factory=list)  # per epoch (under torchrun)

    @property
    def failed(self) -> bool:
        return self.error is not None or self.fatal is not None

    def figures(self) -> RepeatMetrics:
        """Its metrics, which a report kept for the results has."""
        if self.metrics is None:
            raise ValueError(f"rank {self.rank} has no figures of this run")
        return self.metrics
