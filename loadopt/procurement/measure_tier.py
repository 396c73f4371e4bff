"""One tier of `loadopt tiers` (`run_tiers`): its dataset through a fresh tier instance, its probe and
the prediction from it, its search over accelerator counts, whether the storage under it bounded the figures,
its cost, and its row."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

from loadopt.config_models import Config
from loadopt.procurement.consumers import ConsumerSettings, PlayTrial
from loadopt.procurement.plan import (
    QUICK_PROBE_S,
    Prediction,
    TierPlan,
    TiersOptions,
    predict,
    predict_from,
    probe_levels,
    probe_points,
    profile_points,
    search,
)
from loadopt.procurement.tiers_document import BaseBound, CutShort, MeasuredTier, MeasuredTrial, TierSeconds
from loadopt.progress import TiersProgress
from loadopt.schema.tiers import TierCost
from loadopt.storage.tiers.probe import ProbeResult, probe
from loadopt.storage.tiers.spec import TierSpec
from loadopt.storage.tiers.stack import (
    BASE_BOUND_SHARE,
    base_bound_text,
    base_share,
    storage_under,
    tier_counters,
    tier_filesystem,
)

if TYPE_CHECKING:
    from loadopt.storage.dataset import Dataset

# ---------------------------------------------------------------------------------------------
# A tier's dataset and its costs


def tier_dataset(dataset, spec: TierSpec):
    """The dataset read through a fresh instance of tier `spec` (its own clock, slots and counters)."""
    from loadopt.storage.tiers.emulated import EmulatedFileSystem

    base = dataset.fs.base_fs if isinstance(dataset.fs, EmulatedFileSystem) else dataset.fs
    return dataclasses.replace(dataset, fs=tier_filesystem(spec, base))


def tier_costs(spec: TierSpec, capacity_tb: float, supported: int) -> dict[str, float | None]:
    if spec.price_per_tb_month is None:
        return {"per_month": None, "per_accelerator_month": None}
    per_month = spec.price_per_tb_month * capacity_tb
    return {"per_month": per_month, "per_accelerator_month": per_month / supported if supported else None}


# ---------------------------------------------------------------------------------------------
# One tier: its probe, its search, what bounded it


@dataclasses.dataclass(frozen=True)
class TierProbe:
    """The probe of a tier (`dataset_probe`) and what it says: the prediction, the base's share, the storage."""

    result: ProbeResult  # loadopt.storage.tiers.probe's
    prediction: Prediction
    base_share: float | None
    storage: str  # the storage under the tier (`storage_under`)
    seconds: float


def _probe_tier(spec: TierSpec, dataset: Dataset, plan: TierPlan, need: dict[str, float], options: TiersOptions,
                say: TiersProgress) -> TierProbe:
    say.status(f"{spec.name}: probing")
    began = time.perf_counter()
    probed_on = tier_dataset(dataset, spec)
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
        tiered = tier_dataset(dataset, spec)
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


def measure_tier(config: Config, spec: TierSpec, dataset: Dataset, plan: TierPlan, need: dict[str, float],
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
    """The row of tiers.json (loadopt.schema.documents.TierRow, schema version 2: one key each, those `loadopt report`
    reads)."""
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


def tier_line(row: MeasuredTier, trials: int, searched_s: float, tier_s: float) -> str:
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
    from loadopt.storage.sources.records import RecordDataset

    if isinstance(dataset, RecordDataset):  # <root>/<record file>
        root = os.path.dirname(dataset.files[0].decode())
    else:  # <root>/<class>/<sample>, as the tier's fs names it
        root = os.path.dirname(os.path.dirname(dataset.path(0)))
    return probe(root, fs=dataset.fs, block_sizes=(), concurrencies=probe_levels(most_in_flight), duration_s=duration_s,
                 seq_bytes=64 << 20, whole_files=True, cold=False, max_requests=200_000, sequential=sequential)
