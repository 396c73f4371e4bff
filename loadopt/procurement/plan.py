"""What a storage tier should support, before measuring it: each accelerator's need, the search over
accelerator counts, the prediction from a probe or from the tier's own figures, the backends compared
through it, and the plan `loadopt tiers` says up front (trials, backend runs, about how long).

`run_tiers` measures what this plans."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import numpy as np
from pydantic import BaseModel

from loadopt.config import backend_settings
from loadopt.config_models import Config
from loadopt.errors import ConfigError
from loadopt.procurement.consumers import ConsumerSettings, start_delay_s
from loadopt.schema.documents import Knobs
from loadopt.storage.tiers.probe import ProbeResult
from loadopt.storage.tiers.spec import TierSpec

PROBE_LEVELS = (1, 4, 16, 64)  # whole-sample reads in flight that the probe measures
TRIAL_JOIN_S = 0.3  # a trial's forks and its collection, beyond its start delay and its window (an estimate)
BACKEND_START_S = 2.0  # a backend's start, eviction and close, beyond its batches (an estimate, for the plan)
BACKEND_IN_FLIGHT = 2  # requests a backend keeps in flight through the tier, for the plan (the configs' threads)
QUICK_PROBE_S = 0.5  # --quick: seconds per probed level, and no sequential pattern (the prediction reads none)
QUICK_BACKEND_RUN_S = 6.0  # --quick: each backend's batches through the tier take about this at most


def demand(config: Config, mean_sample_bytes: float, au: float) -> dict[str, float]:
    """The workload's need per accelerator: MB/s at full utilisation and at the AU threshold."""
    step_s = config.workload.step_time_ms / 1000.0
    if step_s <= 0:
        raise ConfigError(f"{config.source}: workload.step_time_ms: must be positive for `loadopt tiers` "
                          "(an accelerator that needs no time needs infinite bandwidth)")
    batch_bytes = config.pipeline.batch_size * mean_sample_bytes
    full = batch_bytes / step_s / 1e6
    return {"batch_bytes": batch_bytes, "step_time_ms": step_s * 1000.0, "mb_per_s": full,
            "mb_per_s_at_threshold": full * au, "mean_sample_bytes": mean_sample_bytes}


class SearchTrial(Protocol):
    """What `search` reads of a trial: how many accelerators ran at once and the mean AU they kept."""

    @property
    def accelerators(self) -> int: ...

    @property
    def accelerator_utilisation(self) -> float: ...


TrialT = TypeVar("TrialT", bound=SearchTrial)


@dataclasses.dataclass(frozen=True)
class Utilisation:
    """A trial's outcome alone: what `search` needs (`search_trials` plays the search with these)."""

    accelerators: int
    accelerator_utilisation: float


def search(trial: Callable[[int], TrialT], threshold: float, max_n: int,
           budget_s: float) -> tuple[int, list[TrialT], str]:
    """The largest N in [0, max_n] whose trial keeps mean AU >= threshold: doubling, then bisection.
    Returns (N, the trials, a note on what bounded the search)."""
    started = time.perf_counter()
    trials: list[TrialT] = []
    passed, failed = 0, None

    def run(n: int) -> bool:
        result = trial(n)
        trials.append(result)
        return result.accelerator_utilisation >= threshold

    n = 1
    while True:
        if not run(n):
            failed = n
            break
        passed = n
        if n >= max_n or time.perf_counter() - started > budget_s:
            break
        n = min(2 * n, max_n)
    while failed is not None and failed - passed > 1 and time.perf_counter() - started <= budget_s:
        middle = (passed + failed) // 2
        if run(middle):
            passed = middle
        else:
            failed = middle
    if failed is None:
        note = f"at least {passed}: the search stops at --max-accelerators {max_n}" if passed >= max_n else \
            f"at least {passed}: the time budget ran out"
    elif failed - passed > 1:
        note = f"between {passed} and {failed - 1}: the time budget ran out"
    else:
        note = f"{failed} accelerator{'s fall' if failed > 1 else ' falls'} below the threshold"
    return passed, trials, note


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through (concurrency, MB/s), flat beyond the last point, through (0, 0)."""
    xs = [0.0] + [p[0] for p in points]
    ys = [0.0] + [p[1] for p in points]
    return float(np.interp(x, xs, ys))


def search_trials(supported: int, max_n: int) -> list[int]:
    """The accelerator counts `search` tries when `supported` of them pass and more fail (no time budget)."""
    trials = search(lambda n: Utilisation(n, float(n <= supported)), 0.5, max_n, math.inf)[1]
    return [t.accelerators for t in trials]


def probe_points(probe_result: ProbeResult) -> list[tuple[float, float]]:
    """(requests in flight, MB/s) of the probe's whole-sample reads."""
    return sorted((p["concurrency"], p["mb_per_s"]) for p in probe_result["patterns"]
                  if p["pattern"] == "files" and "skipped" not in p)


def profile_points(spec: TierSpec, request_bytes: float, levels: tuple[int, ...] = PROBE_LEVELS
                   ) -> list[tuple[float, float]]:
    """(requests in flight, MB/s) that the tier's own figures give whole-sample reads; [] without figures."""
    points = [(float(c), spec.profile_mb_s(c, request_bytes)) for c in levels]
    return [(c, m) for c, m in points if m is not None]


class ProbePoint(BaseModel):
    """What a tier delivers to whole-sample reads at one concurrency: the probe's, or the tier's own figures'."""

    concurrency: int | float  # (requests in flight: the probe's levels, or the figures' as floats)
    mb_per_s: float


class Prediction(BaseModel):
    """N_pred: how many accelerators a tier should keep at the AU threshold, and from what. Dumped with
    `exclude_unset` (a tiers.json row's `prediction`): a field not set is a key the row does not have."""

    accelerators: int | None  # None: nothing to predict from
    deliverable_mb_s: float | None = None  # what the tier delivers to that many accelerators
    probe_points: list[ProbePoint] | None = None
    note: str
    source: str | None = None  # "the probe", or the tier's own figures (set by procurement)
    probe_accelerators: int | None = None  # what the probe predicted, where the tier's figures replaced it


def predict(probe_result: ProbeResult, need_mb_s: float, readers: int, max_n: int) -> Prediction:
    """N_pred from the probe's whole-sample reads: the largest N whose share of what the tier delivers
    at N x readers requests in flight is at least `need_mb_s` (the per-accelerator demand at the AU
    threshold)."""
    points = probe_points(probe_result)
    if not points:
        return Prediction(accelerators=None, note="the probe measured no whole-sample reads")
    return predict_from(points, need_mb_s, readers, max_n)


def predict_from(points: list[tuple[float, float]], need_mb_s: float, readers: int, max_n: int) -> Prediction:
    """`predict` from (requests in flight, MB/s) points: the probe's, or a tier's own figures'."""
    supported = 0
    for n in range(1, max_n + 1):
        if _interpolate(points, n * readers) / n >= need_mb_s:
            supported = n
        else:
            break
    deliverable = _interpolate(points, max(supported, 1) * readers)
    return Prediction(accelerators=supported, deliverable_mb_s=deliverable,
                      probe_points=[ProbePoint(concurrency=c, mb_per_s=m) for c, m in points],
                      note=f"at most {max_n} (--max-accelerators)" if supported >= max_n else "")


def backend_sweep(config: Config, quick: bool = False) -> dict[str, Knobs]:
    """The backends to compare on each tier: the config's, arrow and posix in both forms (images; records
    and tokens have one stored form, whatever `form` says), every other swept knob at its last (most
    parallel) listed value; `quick` takes the last `variant` too (the stored forms are the tier's question)."""
    loaders: dict[str, Knobs] = {}
    one_form = config.dataset.kind != "images"
    kept = ("form",) if quick else ("form", "variant")
    for name, raw in config.loaders.items():
        settings = {k: (v[-1] if isinstance(v, list) and v and (one_form or k not in kept) else v)
                    for k, v in raw.items()}
        if name in ("arrow", "posix", "kvikio") and not one_form:
            settings["form"] = ["decoded", "encoded"]
        loaders[name] = settings
    return loaders


# ---------------------------------------------------------------------------------------------
# The plan: what runs on each tier, and about how long it takes


@dataclasses.dataclass
class TierPlan:
    """What `run_tiers` does on one tier and about how long it takes, from the tier's own figures (the storage
    under it may be slower: then it takes longer)."""

    name: str
    most: int  # the search's bound: --max-accelerators, the dataset's shards or the torchrun job's ranks
    bound: str | None  # what set `most` when it is not --max-accelerators
    expected_accelerators: int | None  # from the tier's figures; None without figures
    expected_trials: list[int]  # the counts the search tries if the tier's figures hold
    longest_trials: list[int]  # the longest search there can be
    probe_s: float
    backend_settings: int  # 0: no backend compared on it
    backend_warmup: int
    backend_batches: int
    batch_s: float  # a batch through the tier by its figures (the step time at least)
    backend_note: str = ""  # why fewer batches, or none

    def trial_s(self, count: int, warmup_s: float, measure_s: float) -> float:
        return start_delay_s(count) + warmup_s + measure_s + TRIAL_JOIN_S

    def seconds(self, warmup_s: float, measure_s: float, budget_s: float, worst: bool = False) -> float:
        """Its probe, search and backends: as its figures say (`worst`: every trial the search may run)."""
        counts = self.longest_trials if worst else self.expected_trials
        search_s, longest = 0.0, 0.0
        for count in counts:
            if search_s > budget_s:  # the search stops once its budget is spent (after the trial running then)
                break
            longest = self.trial_s(count, warmup_s, measure_s)
            search_s += longest
        backends_s = self.backend_settings * (BACKEND_START_S + (self.backend_warmup + self.backend_batches)
                                              * self.batch_s)
        return self.probe_s + search_s + backends_s


def plan_tier(config: Config, spec: TierSpec, dataset, *, au: float, max_accelerators: int, readers: int,
              probe_s: float, ranks: int | None, backends: bool, backend_warmup: int, backend_batches: int,
              quick: bool) -> TierPlan:
    """The plan of one tier (`TierPlan`): its search's bound, the trials its figures lead to, its backends."""
    batch = config.pipeline.batch_size
    most, bound = max_accelerators, None
    by_data = max(1, len(dataset) // batch)  # each accelerator reads its own shard
    if by_data < most:
        most, bound = by_data, (f"bounded by the dataset: {len(dataset):,} samples give at most {by_data} "
                                f"accelerators a batch of {batch} each (a larger dataset lifts it)")
    if ranks is not None and ranks < most:
        most, bound = ranks, f"bounded by the torchrun job: {ranks} ranks, one accelerator each"
    mean = float(dataset.sizes.mean())
    figures = profile_points(spec, mean, probe_levels(most * readers))
    expected = predict_from(figures, demand(config, mean, au)["mb_per_s_at_threshold"], readers, most
                            ).accelerators if figures else None
    longest = max((search_trials(n, most) for n in range(most + 1)), key=len)
    sequence = search_trials(expected, most) if expected is not None else longest
    step_s = config.workload.step_time_ms / 1000.0
    rate = spec.profile_mb_s(BACKEND_IN_FLIGHT, mean)
    batch_s = max(step_s, batch * mean / (rate * 1e6)) if rate else step_s
    settings = sum(len(backend_settings(config.model_copy(update={"loaders": backend_sweep(config, quick)}), name))
                   for name in config.loaders) if backends else 0
    warmup, batches, note = backend_warmup, backend_batches, ""
    if settings and quick:
        fit = int(QUICK_BACKEND_RUN_S / batch_s) - warmup
        if fit < 2:
            settings, batches = 0, 0
            note = (f"not compared under --quick: a batch of {batch} through {spec.name} takes about {batch_s:,.1f} s "
                    f"by its figures (run without --quick to compare the backends on it)")
        elif fit < batches:
            batches, note = fit, f"{fit} measured batches under --quick (a batch takes about {batch_s:,.2f} s)"
    probed = probe_s * (len(probe_levels(most * readers)) + (0 if quick else 1))
    return TierPlan(spec.name, most, bound, expected, sequence, longest, probed, settings, warmup, batches, batch_s,
                    note)


def plan_line(plans: list[TierPlan], warmup_s: float, measure_s: float, budget_s: float) -> str:
    """The plan said up front: the tiers, the trials at most, the backends, about how long in all."""
    expected = sum(p.seconds(warmup_s, measure_s, budget_s) for p in plans)
    worst = sum(p.seconds(warmup_s, measure_s, budget_s, worst=True) for p in plans)
    trials = sum(len(p.expected_trials) for p in plans)
    at_most = sum(len(p.longest_trials) for p in plans)
    runs = sum(p.backend_settings for p in plans)
    backends = (f"; {runs} backend runs through them, cold ({max(p.backend_warmup for p in plans)} + up to "
                f"{max(p.backend_batches for p in plans)} batches each)") if runs else ""
    return (f"{len(plans)} tier{'s' if len(plans) != 1 else ''} ({', '.join(p.name for p in plans)}): a probe and "
            f"about {trials} trials of {warmup_s:g} + {measure_s:g} s (at most {at_most}, {budget_s:g} s of search a "
            f"tier){backends}; about {duration_text(expected)} in all by the tiers' own figures (at most about "
            f"{duration_text(worst)}; longer where the storage under a tier is slower than its figures)")


def duration_text(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def probe_levels(most_in_flight: int) -> tuple[int, ...]:
    """The probe's levels: those of PROBE_LEVELS below `most_in_flight`, and that one (never more in flight)."""
    return tuple(sorted({c for c in PROBE_LEVELS if c < most_in_flight} | {min(PROBE_LEVELS[-1], most_in_flight)}))


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
    relist: bool = False  # list the dataset again (`--relist`), once per location, instead of its saved listing

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
                                self.prefetch, config.seed, config.pipeline.shuffle, config.pipeline.drop_last,
                                config.pipeline.window_shards, config.pipeline.shard_samples)
