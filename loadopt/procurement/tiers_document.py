"""What `loadopt tiers` records, as typed models: a trial of a tier's search, a backend run through a tier
and the decision among them, a tier's row, and the whole run (tiers.json).

Each model is dumped with `exclude_unset` (`TiersRun.document`): a field that was never set is a key the
file does not have (a row's `backends` without --backends, a run's metrics where it measured nothing), so
the document keeps exactly the keys and values `loadopt tiers` has always written.
`run_tiers` measures these; `loadopt.schema.documents` validates the file they are written to.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel

from loadopt.machine import MachineInfo
from loadopt.procurement.consumers import TrialFigures
from loadopt.procurement.plan import Prediction
from loadopt.schema.documents import ConfigDump, Recipe, Run, RunStatus
from loadopt.schema.tiers import TierRow


class MeasuredTrial(BaseModel):
    """One trial of a tier's search: the consumers' figures together (not each one's), and how it went."""

    accelerators: int
    accelerator_utilisation: float  # the mean over the consumers
    min_accelerator_utilisation: float
    samples_per_s: float
    mb_per_s: float
    failed_reads: int
    cpu_load: float
    base_share: float | None  # the share of the reads' time the storage under the tier took past its figures
    seconds: float  # the trial's own, forks and collection included
    passed: bool  # AU at least the threshold

    @classmethod
    def of(cls, figures: TrialFigures, base_share: float | None, seconds: float, threshold: float) -> MeasuredTrial:
        together = {f.name: getattr(figures, f.name) for f in dataclasses.fields(figures) if f.name != "per_consumer"}
        return cls(**together, base_share=base_share, seconds=seconds,
                   passed=figures.accelerator_utilisation >= threshold)


class BackendRun(BaseModel):
    """One backend setting run through a tier (one accelerator, cold), from its bench's results."""

    label: str
    backend: str
    status: RunStatus
    reason: str
    form: str | None
    bytes_source: str | None
    recipe: Recipe | None  # a setting of another recipe never becomes the tier's decision
    bounded_by_base: str | None
    # the medians of what it measured; a run that measured nothing has none of these keys
    samples_per_s: int | float | None = None
    mb_per_s: int | float | None = None
    accelerator_utilisation: int | float | None = None
    bytes_read: int | float | None = None
    tier_bytes: int | float | None = None
    wall_s: int | float | None = None


class RunnerUp(BaseModel):
    label: str
    backend: str
    samples_per_s: int | float | None


class Excluded(BaseModel):
    """A faster setting of another recipe, never chosen: what it delivers differently."""

    label: str
    differences: list[str]


class TierDecision(BaseModel):
    """The decision recorded for a tier (the keys of its bench's decision that `loadopt tiers` keeps)."""

    backend: str | None = None
    label: str | None = None
    samples_per_s: int | float | None = None
    runner_up: RunnerUp | None = None
    margin: float | None = None
    text: str | None = None
    excluded: list[Excluded] | None = None
    bounded_by_base: str | None = None


class BackendComparison(BaseModel):
    """Every backend through one tier (`tier_backends.compare_backends`), or why none was compared."""

    runs: list[BackendRun]
    ranking: list[str]
    results: str | None  # the bench's results.json; None: nothing was written
    decision: TierDecision | None
    skipped: str | None = None  # set where no backend was compared: why
    interrupted_by: str | None = None  # set where Ctrl-C or SIGTERM stopped the runs (those that finished are kept)


class TierSeconds(BaseModel):
    probe: float
    search: float
    backends: float


class BaseBound(BaseModel):
    """What the storage under an emulated tier took of its reads' time, against the share that bounds a row."""

    storage: str
    probe_share: float | None
    deciding_trial_share: float | None  # the trial that fell short above the count: it set the count
    bound_share: float


class MeasuredTier(TierRow):
    """One tier's row of tiers.json: `TierRow`'s keys (those `loadopt report` reads) and what measured them."""

    spec: ConfigDump  # the tier's figures, credentials removed (TierSpec.redacted)
    au_by_accelerators: list[tuple[int, float]]  # (accelerators, AU) of every trial, by count
    prediction: Prediction
    capacity_tb: float
    seconds: TierSeconds
    base: BaseBound
    trials: list[MeasuredTrial]
    probe: dict[str, Any]  # loadopt.storage.tiers.probe's result, as `loadopt probe` writes it
    backends: BackendComparison | None = None  # set with --backends


class TorchrunConsumers(BaseModel):
    ranks: int
    nodes: int
    note: str


class ConsumerDescription(BaseModel):
    """What played each accelerator."""

    kind: str
    readers: int
    prefetch_batches: int
    warmup_s: float
    measure_s: float
    max_accelerators: int
    torchrun: TorchrunConsumers | None = None  # set under torchrun (`run_tiers_here`)


class PlanSummary(BaseModel):
    """The plan said up front, summed over the tiers."""

    tiers: list[str]
    trials_expected: int
    trials_at_most: int
    expected_s: float
    at_most_s: float


class CutShort(BaseModel):
    """The tier a stop cut short: where it was, and the trials it had run (in its probe or search)."""

    tier: str
    stage: Literal["probe", "search", "backends"]
    trials: list[MeasuredTrial] = []  # set in the probe and the search; unset (no key) in the backends


class TiersRun(BaseModel):
    """A run of `loadopt tiers`: the tiers that finished, and how they were measured (tiers.json)."""

    schema_version: int
    command: str
    created: str
    config_source: str
    config: dict[str, str]  # the config's name
    machine: MachineInfo  # loadopt.machine.machine_info
    device: str
    au_threshold: float
    quick: bool
    demand: dict[str, float] | None  # each accelerator's need (tier_plan.demand); None before any tier
    consumer: ConsumerDescription
    plan: PlanSummary
    elapsed_s: float
    interrupted: bool
    runs: list[Run]  # none: no loader settings (the report shows the tiers section of this file)
    tiers: list[MeasuredTier]
    interrupted_by: str | None = None  # set where Ctrl-C or SIGTERM stopped it
    cut_short: CutShort | None = None  # set where a stop cut a tier short: what it had measured, not a row

    def document(self) -> dict[str, Any]:
        """The JSON-shaped document (tiers.json's content): the keys that were set, nothing added."""
        return self.model_dump(exclude_unset=True)
