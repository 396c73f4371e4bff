"""`loadopt tiers`: how many accelerators each storage tier keeps busy, measured and predicted.

The question is MLPerf Storage's: the largest number N of emulated accelerators a tier keeps at a
mean accelerator utilisation (AU) of at least the threshold (0.9) for the configured workload.

Measured: N consumer processes run at once, each with its own reader of the tier and its own shard
of the data (rank i of N in the shared sample order). A consumer is a storage reader, as DLIO and
MLPerf Storage use: `readers` threads fetch the stored bytes of the next `prefetch` batches through
the tier (no decode: the question is the storage's), and the emulated accelerator takes `step_time`
per batch. All consumers start together and are measured over the same window after a warm-up, so
none of them gets the tier to itself at the end; AU is the step time inside the window over its
length. N is searched exponentially (1, 2, 4, ...) until AU falls below the threshold, then by
bisection, bounded by `max_accelerators`. Each trial uses a fresh tier instance (its own bandwidth
clock), forked from this process, so the consumers share the tier's limits as they would share the
real device.

Backends: the same question asked of the input paths. Each configured backend (arrow and posix in
both forms, decoded and encoded, side by side; every other swept knob at its last listed value) runs
through the harness as one accelerator on the tier, cold, every byte through the tier
(storage/tier_reads.py); the fastest is that tier's decision, recorded as `loadopt bench` records it
(keyed by the tier), so `make_loader(backend="auto")` follows the tier: on a slow one the smaller
encoded form can win, on a fast one the decoded form (bench/tier_backends.py).

Predicted: from `loadopt probe` of the tier (whole-sample reads of the dataset at concurrency 1, 4,
16 and 64): N consumers with `readers` threads each keep about N x readers requests in flight, so
the tier delivers the probe's MB/s at that concurrency (interpolated, flat past the last level);
each consumer needs AU x batch bytes / step time. N_pred is the largest N whose share meets that.

Bounded by the storage under it: an emulated tier can only slow its base down. Where the base's own
reads ran past the times the tier's figures give them (a share of the request time of at least
`BASE_BOUND_SHARE`, in the probe or in the trial that decided the count), the measured figures are the
base's, not the tier's: the row says so (`bounded_by_base`), and the prediction comes from the tier's
own figures (`TierSpec.profile_mb_s`) instead of the probe.

Up front, the plan (`TierPlan`, from the tiers' own figures): how many trials at most and about how
long; as it goes, one line per trial, per backend run and per tier (`TiersProgress`). Ctrl-C or
SIGTERM keeps the tiers that finished (`interrupted_by`, and the trials of the tier cut short).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import time
from typing import TYPE_CHECKING, Any

from loadopt.bench.consumers import ConsumerSettings, PlayTrial, run_consumers
from loadopt.bench.tier_backends import tier_backends
from loadopt.bench.tier_plan import (
    QUICK_PROBE_S,
    Prediction,
    TierPlan,
    demand,
    duration_text,
    plan_line,
    plan_tier,
    predict,
    predict_from,
    probe_levels,
    probe_points,
    profile_points,
    search,
)
from loadopt.bench.tier_results import (
    BaseBound,
    ConsumerDescription,
    CutShort,
    MeasuredTier,
    MeasuredTrial,
    PlanSummary,
    TierSeconds,
    TiersRun,
)
from loadopt.config_models import Config
from loadopt.errors import ConfigError, Terminated
from loadopt.progress import TiersProgress
from loadopt.schema import SCHEMA_VERSION, TierCost
from loadopt.storage.probe import ProbeResult, probe
from loadopt.storage.tiers import (
    BASE_BOUND_SHARE,
    TierSpec,
    base_bound_text,
    base_share,
    resolve_tier,
    storage_under,
    tier_counters,
    tier_filesystem,
)

if TYPE_CHECKING:
    from loadopt.storage.dataset import Dataset

# ---------------------------------------------------------------------------------------------
# A tier's dataset and its costs


def _tier_dataset(dataset, spec: TierSpec):
    """The dataset read through a fresh instance of tier `spec` (its own clock, slots and counters)."""
    from loadopt.storage.emulated import EmulatedFileSystem

    base = dataset.fs.base_fs if isinstance(dataset.fs, EmulatedFileSystem) else dataset.fs
    return dataclasses.replace(dataset, fs=tier_filesystem(spec, base))


def _open_for_tier(config: Config, spec: TierSpec):
    from loadopt.storage.imagefolder import open_dataset

    tier_config = config.model_copy(update={"storage": config.storage.model_copy(
        update={"tier": spec.model_dump(mode="json")})})
    dataset = open_dataset(tier_config)
    if dataset.kind == "tokens":
        raise ConfigError(f"{config.source}: dataset.kind: `loadopt tiers` reads image datasets and records "
                          "(sample files), not a memory-mapped token corpus")
    return dataset


def tier_costs(spec: TierSpec, capacity_tb: float, supported: int) -> dict[str, float | None]:
    if spec.price_per_tb_month is None:
        return {"per_month": None, "per_accelerator_month": None}
    per_month = spec.price_per_tb_month * capacity_tb
    return {"per_month": per_month, "per_accelerator_month": per_month / supported if supported else None}


# ---------------------------------------------------------------------------------------------
# The procurement table


@dataclasses.dataclass(frozen=True)
class TiersOptions:
    """How `run_tiers` measures each tier (its keyword arguments, checked)."""

    au: float
    max_accelerators: int
    readers: int
    prefetch: int
    warmup_s: float
    measure_s: float
    probe_s: float
    budget_s: float
    capacity_tb: float | None
    backends_out: str | None
    backend_warmup: int
    backend_batches: int
    ranks: int | None
    quick: bool

    def __post_init__(self) -> None:
        if not 0 < self.au <= 1:
            raise ConfigError(f"--au {self.au}: expected a utilisation threshold in (0, 1]")
        if self.max_accelerators < 1:
            raise ConfigError(f"--max-accelerators {self.max_accelerators}: expected at least 1")

    def seconds(self, plans: list[TierPlan], worst: bool = False) -> float:
        """About how long `plans` take (`worst`: every trial their searches may run)."""
        return sum(p.seconds(self.warmup_s, self.measure_s, self.budget_s, worst=worst) for p in plans)

    def consumer(self, config: Config) -> ConsumerSettings:
        """What each emulated accelerator's consumer does, for the config's workload."""
        return ConsumerSettings(config.pipeline.batch_size, config.workload.step_time_ms / 1000.0, self.readers,
                                self.prefetch, config.seed, config.pipeline.shuffle, config.pipeline.drop_last)


@dataclasses.dataclass
class TiersSoFar:
    """What the tier loop carries: each tier's plan, the rows of those that finished, the tier running and
    how far it got (what a stop keeps: `cut_short`), and what stopped it."""

    plans: list[TierPlan] = dataclasses.field(default_factory=list)
    rows: list[MeasuredTier] = dataclasses.field(default_factory=list)
    need: dict[str, float] | None = None  # each accelerator's need (`demand`), of the last tier begun
    current: CutShort | None = None
    interrupted_by: str | None = None


def run_tiers(config: Config, tiers: list[str | dict[str, Any]], *, au: float = 0.9, max_accelerators: int = 64,
              readers: int = 4, prefetch: int = 2, warmup_s: float = 1.0, measure_s: float = 3.0,
              probe_s: float = 1.0, budget_s: float = 300.0, capacity_tb: float | None = None,
              progress: TiersProgress | None = None, backends_out: str | None = None, backend_warmup: int = 3,
              backend_batches: int = 20, consumers: PlayTrial = run_consumers,
              ranks: int | None = None, quick: bool = False) -> TiersRun:
    """For each tier: supported accelerators (measured and predicted), with what was delivered and cost;
    with `backends_out` (a folder), also every backend compared on it (`compare_backends`). `consumers` plays
    a trial's accelerators (forked processes; under torchrun the job's `ranks`, bench/tier_ranks.py).
    `quick`: no sequential probe, the last `variant` only, and each tier's backend runs sized to its figures.
    Ctrl-C or SIGTERM ends it early with the tiers that finished (`interrupted_by`)."""
    options = TiersOptions(au, max_accelerators, readers, prefetch, warmup_s, measure_s, probe_s, budget_s, capacity_tb,
                           backends_out, backend_warmup, backend_batches, ranks, quick)
    say = progress or TiersProgress()
    started = time.perf_counter()
    specs = [resolve_tier(t, where=f"--tiers {t}") for t in tiers]
    so_far = TiersSoFar()
    try:
        datasets = _plan_tiers(config, specs, options, say, so_far.plans)
        say.line(plan_line(so_far.plans, warmup_s, measure_s, budget_s))
        for index, (spec, dataset) in enumerate(zip(specs, datasets, strict=True)):
            row = _run_tier(config, spec, dataset, index, options, consumers, say, so_far, started)
            so_far.interrupted_by = row.backends.interrupted_by if row.backends is not None else None
            if so_far.interrupted_by:
                so_far.current = None  # the tier's row is kept, with the backend runs that finished
                break
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where the caller made it one (errors.Terminated)
        so_far.interrupted_by = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    return _tiers_run(config, options, so_far, time.perf_counter() - started)


def _plan_tiers(config: Config, specs: list[TierSpec], options: TiersOptions, say: TiersProgress,
                plans: list[TierPlan]) -> list[Dataset]:
    """Each tier's dataset, opened; its plan appended to `plans` (those planned are kept if a stop comes)."""
    datasets = []
    for spec in specs:
        say.status(f"{spec.name}: opening the dataset")
        datasets.append(_open_for_tier(config, spec))
        plans.append(plan_tier(config, spec, datasets[-1], au=options.au, max_accelerators=options.max_accelerators,
                               readers=options.readers, probe_s=options.probe_s, ranks=options.ranks,
                               backends=options.backends_out is not None, backend_warmup=options.backend_warmup,
                               backend_batches=options.backend_batches, quick=options.quick))
    return datasets


def _run_tier(config: Config, spec: TierSpec, dataset: Dataset, index: int, options: TiersOptions,
              consumers: PlayTrial, say: TiersProgress, so_far: TiersSoFar, started: float) -> MeasuredTier:
    """Tier `index`: its row (probe and search), then every backend through it; the row is in `so_far` once its
    search ended (a stop in its backends keeps it)."""
    plan = so_far.plans[index]
    tier_started = time.perf_counter()
    so_far.current = CutShort(tier=spec.name, stage="probe", trials=[])
    so_far.need = demand(config, float(dataset.sizes.mean()), options.au)
    row = _measure_tier(config, spec, dataset, plan, so_far.need, options, consumers, say, so_far.current)
    so_far.rows.append(row)
    searched_s = time.perf_counter() - tier_started
    backends_started = time.perf_counter()
    if options.backends_out is not None:
        so_far.current = CutShort(tier=spec.name, stage="backends")
        row.backends = tier_backends(config, spec, plan, options.backends_out, options.quick, say,
                                      row.bounded_by_base)
    row.seconds.backends = time.perf_counter() - backends_started
    elapsed = time.perf_counter() - started
    left = options.seconds(so_far.plans[index + 1:])
    say.line(_tier_line(row, len(row.trials), searched_s, time.perf_counter() - tier_started) +
             f" [{duration_text(elapsed)} in all{f', about {duration_text(left)} left' if left else ''}]")
    return row


def _tiers_run(config: Config, options: TiersOptions, so_far: TiersSoFar, elapsed_s: float) -> TiersRun:
    """The run's document: the tiers that finished, how they were measured, and what stopped it."""
    from loadopt.machine import machine_info

    plans = so_far.plans
    run = TiersRun(
        schema_version=SCHEMA_VERSION, command="loadopt tiers",
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        config_source=config.source, config={"name": config.name}, machine=machine_info(),
        device="emulated accelerators", au_threshold=options.au, quick=options.quick, demand=so_far.need,
        consumer=ConsumerDescription(
            kind="storage reader (the samples' stored bytes, no decode; as DLIO / MLPerf Storage)",
            readers=options.readers, prefetch_batches=options.prefetch, warmup_s=options.warmup_s,
            measure_s=options.measure_s, max_accelerators=options.max_accelerators),
        plan=PlanSummary(tiers=[p.name for p in plans], trials_expected=sum(len(p.expected_trials) for p in plans),
                         trials_at_most=sum(len(p.longest_trials) for p in plans),
                         expected_s=options.seconds(plans), at_most_s=options.seconds(plans, worst=True)),
        elapsed_s=elapsed_s, interrupted=so_far.interrupted_by is not None, runs=[], tiers=so_far.rows)
    if so_far.interrupted_by is not None:
        run.interrupted_by = so_far.interrupted_by
        if so_far.current is not None:  # the tier cut short: what it had measured, not a row (its search did not end)
            run.cut_short = so_far.current
    return run


# ---------------------------------------------------------------------------------------------
# One tier: its probe, its search, what bounded it


@dataclasses.dataclass(frozen=True)
class TierProbe:
    """The probe of a tier (`dataset_probe`) and what it says: the prediction, the base's share, the storage."""

    result: ProbeResult  # loadopt.storage.probe's
    prediction: Prediction
    base_share: float | None
    storage: str  # the storage under the tier (`storage_under`)
    seconds: float


def _probe_tier(spec: TierSpec, dataset: Dataset, plan: TierPlan, need: dict[str, float], options: TiersOptions,
                say: TiersProgress) -> TierProbe:
    say.status(f"{spec.name}: probing")
    began = time.perf_counter()
    probed_on = _tier_dataset(dataset, spec)
    probed = dataset_probe(probed_on, QUICK_PROBE_S if options.quick else options.probe_s,
                           plan.most * options.readers, sequential=not options.quick)
    seconds = time.perf_counter() - began
    return TierProbe(probed, predict(probed, need["mb_per_s_at_threshold"], options.readers, plan.most),
                     base_share(tier_counters(probed_on.fs)), storage_under(probed_on.fs, str(dataset.root)), seconds)


@dataclasses.dataclass(frozen=True)
class TierSearch:
    """What a tier's search found (`tier_plan.search`): the count kept at the threshold, its trials, what bounded it."""

    count: int
    trials: list[MeasuredTrial]
    note: str
    seconds: float


def _search_tier(spec: TierSpec, dataset: Dataset, plan: TierPlan, settings: ConsumerSettings, options: TiersOptions,
                 consumers: PlayTrial, say: TiersProgress, trials_so_far: list[MeasuredTrial]) -> TierSearch:
    """The search over accelerator counts, a fresh tier instance each trial; each trial is appended to
    `trials_so_far` as it ends (a stop keeps them)."""
    au = options.au
    started = time.perf_counter()

    def trial(n: int) -> MeasuredTrial:
        say.status(f"{spec.name}: {n} accelerator{'s' if n != 1 else ''}")
        began = time.perf_counter()
        tiered = _tier_dataset(dataset, spec)
        figures = consumers(tiered, settings, n, options.warmup_s, options.measure_s)
        share = base_share(tier_counters(tiered.fs))
        result = MeasuredTrial.of(figures, share, time.perf_counter() - began, au)
        trials_so_far.append(result)
        say.line(f"{spec.name}: trial {len(trials_so_far)} (at most {len(plan.longest_trials)}): {n} "
                 f"accelerator{'s' if n != 1 else ''}, AU {result.accelerator_utilisation:.1%} "
                 f"{'>=' if result.passed else '<'} {au:.0%}, {result.mb_per_s:,.1f} MB/s, CPU load "
                 f"{result.cpu_load:.0%} ({result.seconds:.1f} s)")
        return result

    count, trials, note = search(trial, au, plan.most, options.budget_s)
    return TierSearch(count, trials, note, time.perf_counter() - started)


def _measure_tier(config: Config, spec: TierSpec, dataset: Dataset, plan: TierPlan, need: dict[str, float],
                  options: TiersOptions, consumers: PlayTrial, say: TiersProgress, current: CutShort) -> MeasuredTier:
    """One tier's row: its probe, its search, what bounded it, and its cost."""
    probed = _probe_tier(spec, dataset, plan, need, options, say)
    current.stage = "search"
    searched = _search_tier(spec, dataset, plan, options.consumer(config), options, consumers, say, current.trials)
    note = searched.note
    if plan.bound is not None and searched.count == plan.most:
        note = f"at least {plan.most}: the search stops there, {plan.bound}"
    # The trial that set the count: the smallest count above it that fell short.
    short = min((t for t in searched.trials if not t.passed and t.accelerators > searched.count),
                key=lambda t: t.accelerators, default=None)
    trial_share = short.base_share if short is not None else None
    bounded, predicted = _bounded_by_base(spec, dataset, plan, need, options.readers, probed, searched, trial_share)
    if bounded is not None:
        note = f"{note}; {bounded}"
    capacity = options.capacity_tb if options.capacity_tb is not None else float(dataset.sizes.sum()) / 1e12
    return _tier_row(spec, options.au, searched, note, predicted, bounded, probed, trial_share, capacity)


def _bounded_by_base(spec: TierSpec, dataset: Dataset, plan: TierPlan, need: dict[str, float], readers: int,
                     probed: TierProbe, searched: TierSearch,
                     trial_share: float | None) -> tuple[str | None, Prediction]:
    """Whether the storage under the tier bounded its figures (what the row then says), and the prediction: the
    probe's, or where the base bounded it the tier's own figures'."""
    figures = profile_points(spec, float(dataset.sizes.mean()), probe_levels(plan.most * readers))
    by_figures = predict_from(figures, need["mb_per_s_at_threshold"], readers, plan.most) if figures else None
    most_by_figures = (by_figures.accelerators or 0) if by_figures is not None else 0
    from_probe = probed.prediction.accelerators
    # Bounded by the base where its reads ran past the tier's figures and that lowered a count below theirs:
    # the measured one (through the trial that fell short) or the probe's prediction.
    lowered_measured = (trial_share or 0) >= BASE_BOUND_SHARE and most_by_figures > searched.count
    lowered_predicted = (probed.base_share or 0) >= BASE_BOUND_SHARE and most_by_figures > (from_probe or 0)
    if by_figures is not None and (lowered_measured or lowered_predicted):
        delivered = [m for _, m in probe_points(probed.result)] + [t.mb_per_s for t in searched.trials]
        bounded = base_bound_text(spec.name, probed.storage, max(delivered, default=None))
        return bounded, by_figures.model_copy(update={
            "source": "the tier's own figures (the storage under it is slower)", "probe_accelerators": from_probe})
    return None, probed.prediction.model_copy(update={"source": "the probe"})


def _tier_row(spec: TierSpec, au: float, searched: TierSearch, note: str, predicted: Prediction, bounded: str | None,
              probed: TierProbe, trial_share: float | None, capacity: float) -> MeasuredTier:
    """The row of tiers.json (loadopt.schema.TierRow, schema version 2: one key each, those `loadopt report` reads)."""
    measured, trials = searched.count, searched.trials
    cost = tier_costs(spec, capacity, measured)
    at = next((t for t in trials if t.accelerators == measured), None)
    base = BaseBound(storage=probed.storage, probe_share=probed.base_share, deciding_trial_share=trial_share,
                     bound_share=BASE_BOUND_SHARE)
    seconds = TierSeconds(probe=probed.seconds, search=searched.seconds, backends=0.0)
    return MeasuredTier(
        name=spec.name, spec=spec.redacted(), accelerators_supported=measured, measured_note=note, au_threshold=au,
        predicted_accelerators=predicted.accelerators,
        au_by_accelerators=sorted((t.accelerators, t.accelerator_utilisation) for t in trials),
        price_per_tb_month=spec.price_per_tb_month, cost_per_supported_accelerator=cost["per_accelerator_month"],
        prediction=predicted, delivered_mb_s=at.mb_per_s if at else 0.0, samples_per_s=at.samples_per_s if at else 0.0,
        accelerator_utilisation=at.accelerator_utilisation if at else None, cpu_load=at.cpu_load if at else None,
        cost=TierCost(per_month=cost["per_month"]), capacity_tb=capacity, bounded_by_base=bounded, seconds=seconds,
        base=base, trials=trials, probe=probed.result)


def _tier_line(row: MeasuredTier, trials: int, searched_s: float, tier_s: float) -> str:
    """One tier's outcome, as the progress says it."""
    count = row.accelerators_supported
    text = (f"{row.name}: {count} accelerator{'s' if count != 1 else ''} kept at AU >= {row.au_threshold:.0%} "
            f"({row.measured_note}), predicted {row.predicted_accelerators} from "
            f"{row.prediction.source or 'the probe'}; {trials} trials, {searched_s:.0f} s")
    backends = row.backends
    if backends is not None:
        decision = backends.decision
        text += (f"; backends: {backends.skipped}" if backends.skipped else
                 f"; backends {tier_s - searched_s:.0f} s, auto picks {(decision and decision.label) or 'nothing'}")
    return text


def dataset_probe(dataset: Dataset, duration_s: float, most_in_flight: int = 64,
                  sequential: bool = True) -> ProbeResult:
    """The probe of a tier for prediction: whole-sample reads at 1, 4, 16 and 64 in flight (those up to
    `most_in_flight`, and that one: no more are ever in flight in the search), and sequential reads."""
    from loadopt.storage.records import RecordDataset

    if isinstance(dataset, RecordDataset):  # <root>/<record file>
        root = os.path.dirname(dataset.files[0].decode())
    else:  # <root>/<class>/<sample>, as the tier's fs names it
        root = os.path.dirname(os.path.dirname(dataset.path(0)))
    return probe(root, fs=dataset.fs, block_sizes=(), concurrencies=probe_levels(most_in_flight), duration_s=duration_s,
                 seq_bytes=64 << 20, whole_files=True, cold=False, max_requests=200_000, sequential=sequential)
