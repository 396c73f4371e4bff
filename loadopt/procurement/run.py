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
through the harness as one accelerator on the tier, cold, every byte through the tier; the fastest is
that tier's decision, recorded as `loadopt bench` records it (keyed by the tier), so
`make_loader(backend="auto")` follows the tier: on a slow one the smaller encoded form can win, on a fast one
the decoded form (`tier_backends`).

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
import time
from typing import TYPE_CHECKING, Any

from loadopt.config_models import Config
from loadopt.errors import ConfigError, Terminated
from loadopt.procurement.backends import tier_backends
from loadopt.procurement.consumers import PlayTrial, run_consumers
from loadopt.procurement.measure_tier import measure_tier, tier_line
from loadopt.procurement.plan import (
    TierPlan,
    TiersOptions,
    demand,
    duration_text,
    plan_line,
    plan_tier,
)
from loadopt.procurement.tiers_document import (
    ConsumerDescription,
    CutShort,
    MeasuredTier,
    PlanSummary,
    TiersRun,
)
from loadopt.progress import TiersProgress
from loadopt.schema.documents import SCHEMA_VERSION
from loadopt.storage.tiers.spec import (
    TierSpec,
    resolve_tier,
)

if TYPE_CHECKING:
    from loadopt.storage.dataset import Dataset

# ---------------------------------------------------------------------------------------------
# The procurement table


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
              ranks: int | None = None, quick: bool = False, relist: bool = False) -> TiersRun:
    """For each tier: supported accelerators (measured and predicted), with what was delivered and cost;
    with `backends_out` (a folder), also every backend compared on it (`compare_backends`). `consumers` plays
    a trial's accelerators (forked processes; under torchrun the job's `ranks`).
    `quick`: no sequential probe, the last `variant` only, and each tier's backend runs sized to its figures.
    Ctrl-C or SIGTERM ends it early with the tiers that finished (`interrupted_by`). `relist` lists the
    dataset again."""
    options = TiersOptions(au, max_accelerators, readers, prefetch, warmup_s, measure_s, probe_s, budget_s, capacity_tb,
                           backends_out, backend_warmup, backend_batches, ranks, quick, relist)
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
    relisted: set[str | None] = set()  # the tiers' locations (`base`) listed again: each once
    for spec in specs:
        say.status(f"{spec.name}: opening the dataset")
        datasets.append(_open_for_tier(config, spec, options.relist and spec.base not in relisted))
        relisted.add(spec.base)
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
    row = measure_tier(config, spec, dataset, plan, so_far.need, options, consumers, say, so_far.current)
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
    say.line(tier_line(row, len(row.trials), searched_s, time.perf_counter() - tier_started) +
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


def _open_for_tier(config: Config, spec: TierSpec, relist: bool = False):
    from loadopt.storage.open import open_dataset

    tier_config = config.model_copy(update={"storage": config.storage.model_copy(
        update={"tier": spec.model_dump(mode="json")})})
    dataset = open_dataset(tier_config, relist=relist)
    if dataset.kind == "tokens":
        raise ConfigError(f"{config.source}: dataset.kind: `loadopt tiers` reads image datasets and records "
                          "(sample files), not a memory-mapped token corpus")
    return dataset
