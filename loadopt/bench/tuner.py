"""`loadopt bench --tune`: search each backend's knobs for its fastest setting within a time budget.

The knobs and their values come from the backend (`Loader.knob_space(cores)`), never from here; the
config narrows them and sets the start (`search_space`, with the machine's limits).

The search first runs every backend's start; a backend whose start is below `prune_below` of the
fastest start is not climbed (successive halving over backends: knobs move a backend by tens of
percent, not by 2x). The others climb, fastest first: a coordinate-wise hill climb from the start, as
tf.data's autotuner does: for each knob in the backend's order, its other values are tried with the
other knobs at the incumbent (an ordered numeric knob outwards from the incumbent, each direction
until a value does not help), the best value is kept, and passes repeat until one changes nothing
(at most `max_passes`). Each trial is a short run of the harness (`window`), and a trial is stopped
early once it is clearly worse than the incumbent (after `min_batches` measured batches, below
`1 - stop_margin` of its rate). A setting is never proposed when its `cpu_demand` exceeds the usable
cores or its buffers the free shared or pinnable memory. The budget is shared out among the backends
still to tune; no trial starts when its expected length would overrun the backend's share, and a
running trial is cut at the deadline. Format
conversions a knob needs happen before the clock starts.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel

from loadopt.bench.accelerator import make_accelerator
from loadopt.bench.harness import run_repeat
from loadopt.bench.knobs import MachineLimits, directions, numeric, search_space
from loadopt.bench.metrics import BatchProbe
from loadopt.config_models import Config
from loadopt.device import DeviceTransfer
from loadopt.errors import ConfigError, DatasetError, LoadoptError
from loadopt.loaders.base import Loader
from loadopt.loaders.registry import backend_class, backend_for, configured_loader
from loadopt.schema.documents import (
    BackendTuningRecord,
    Knobs,
    Refusal,
    RunStatus,
    TrialRecord,
    TuningSummary,
    knobs_of,
)
from loadopt.storage.dataset import Dataset

log = logging.getLogger(__name__)

Clock = Callable[[], float]
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_budget(text: str) -> float:
    """Seconds in a budget such as `90s`, `10m`, `1h` or `1.5m` (a bare number is seconds)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"--budget {text}: expected a positive duration such as 90s, 10m or 1h")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


@dataclass(frozen=True)
class Window:
    """The short run of one trial, and when a trial counts as clearly worse than the incumbent."""

    warmup_batches: int = 3
    measure_batches: int = 12
    min_batches: int = 3
    stop_margin: float = 0.25  # stopped below 75% of the incumbent's rate
    min_gain: float = 0.03  # a knob moves only for a gain above the noise of short runs
    max_passes: int = 2
    # A backend whose start runs below this fraction of the fastest backend's start is not climbed (a
    # climb gains tens of percent, not 2x): successive halving over backends; 0 climbs every backend.
    prune_below: float = 0.35


@dataclass
class Trial:
    settings: Knobs  # as results.json records them (`schema.knobs_of`)
    label: str
    samples_per_s: float | None = None
    batches: int = 0
    seconds: float = 0.0
    outcome: str = "ok"  # ok | stopped early | cut by the budget | error
    reason: str = ""

    def record(self) -> TrialRecord:
        """The trial as results.json's tuning trace holds it."""
        return TrialRecord(label=self.label, settings=self.settings, samples_per_s=self.samples_per_s,
                           measured_batches=self.batches, seconds=round(self.seconds, 3), outcome=self.outcome,
                           reason=self.reason)


@dataclass
class BackendTuning:
    backend: str
    status: RunStatus = RunStatus.OK
    reason: str = ""
    space: dict[str, list[Any]] = field(default_factory=dict)
    space_size: int = 0
    start: BaseModel | None = None
    refused: list[Refusal] = field(default_factory=list)  # settings over the machine, never run
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    best_settings: BaseModel | None = None
    share_s: float = 0.0
    seconds: float = 0.0

    def record(self) -> BackendTuningRecord:
        """The backend's search as results.json's tuning trace holds it."""
        return BackendTuningRecord(backend=self.backend, status=self.status, reason=self.reason, space=self.space,
                                   space_size=self.space_size, tried=len(self.trials), refused=self.refused,
                                   best=self.best.record() if self.best else None,
                                   budget_share_s=round(self.share_s, 2), seconds=round(self.seconds, 2),
                                   trials=[t.record() for t in self.trials])


class _Stop(Exception):
    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason


def _key(settings: BaseModel) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in settings.model_dump().items()))


class Tuner:
    """Tunes backends one after another within one budget; `tune(names)` returns one result per backend."""

    def __init__(self, config: Config, dataset: Dataset, device: Any, budget_s: float, *, window: Window | None = None,
                 limits: MachineLimits | None = None, clock: Clock = time.monotonic, reporter: Any = None,
                 convert: bool = True) -> None:
        self.config, self.dataset, self.device = config, dataset, torch.device(device)
        self.budget_s, self.window = budget_s, window or Window()
        self.limits, self.clock, self.reporter, self.convert = limits or MachineLimits.here(), clock, reporter, convert
        workload = config.workload
        self.accelerator = make_accelerator(workload.model, workload.step_time_ms, len(dataset.classes), self.device)

    # -- the budget --------------------------------------------------------------------------------

    def tune(self, names: list[str]) -> list[BackendTuning]:
        results = [self._setup(name) for name in names]  # conversions happen here, before the clock starts
        started = self.clock()
        deadline = started + self.budget_s
        todo = [r for r in results if r.status == RunStatus.OK]
        # Round 1: every backend's start, so that the climbs go to the backends that can win.
        seen: dict[str, set[tuple]] = {t.backend: set() for t in todo}
        firsts: dict[str, Trial | None] = {}
        for index, tuning in enumerate(todo):
            assert tuning.start is not None  # an "ok" backend has its start point (_setup)
            now = self.clock()
            share = max(0.0, (deadline - now) / (len(todo) - index))
            firsts[tuning.backend] = self._trial(backend_class(tuning.backend), tuning, tuning.start, None,
                                                 min(deadline, now + share), seen[tuning.backend])
            tuning.seconds = self.clock() - now
        rates = {name: t.samples_per_s for name, t in firsts.items() if t is not None and t.samples_per_s}
        leader = max(rates.values(), default=0.0)
        climbs = sorted(todo, key=lambda t: -rates.get(t.backend, 0.0))
        for index, tuning in enumerate(climbs):
            now = self.clock()
            tuning.share_s = max(0.0, (deadline - now) / (len(climbs) - index))
            first = firsts[tuning.backend]
            rate = rates.get(tuning.backend)
            if rate is not None and rate < self.window.prune_below * leader:
                tuning.best, tuning.best_settings = first, tuning.start
                tuning.reason = (f"not climbed: its start ran at {rate / leader:.0%} of the fastest backend's "
                                 f"start ({rate:,.0f} against {leader:,.0f} samples/s)")
                continue
            self._search(tuning, min(deadline, now + tuning.share_s), first, seen[tuning.backend])
            tuning.seconds += self.clock() - now
        return results

    def _setup(self, name: str) -> BackendTuning:
        tuning = BackendTuning(name)
        cls = backend_for(name, f"--loaders {name}")
        available, reason = cls.available()
        if not available:
            tuning.status, tuning.reason = RunStatus.UNAVAILABLE, reason
            return tuning
        tuning.space, start = search_space(self.config, name, cls, self.limits.cores)
        tuning.space_size = 1
        for values in tuning.space.values():
            tuning.space_size *= len(values)
        tuning.start = self._fit(cls, start, tuning)
        if tuning.start is None:
            tuning.status, tuning.reason = RunStatus.NOT_RUN, "no setting of its knob space fits this machine"
            return tuning
        # Every value of every knob is prepared once now, so that no conversion lands in the budget.
        for key, values in tuning.space.items():
            for value in values:
                point = self._point(cls, tuning.start, key, value)
                if point is None or self.limits.refuses(cls, point, self.config.pipeline):
                    continue
                try:
                    self._build(cls, point, prepare=True).close()
                except DatasetError as exc:  # e.g. a missing conversion under --no-convert: drop the value
                    tuning.space[key] = [v for v in tuning.space[key] if v != value]
                    tuning.refused.append(Refusal(settings=knobs_of(point), reason=str(exc)))
        return tuning

    def _point(self, cls: type[Loader], base: BaseModel, key: str, value: Any) -> BaseModel | None:
        try:
            return cls.Settings(**{**base.model_dump(), key: value})
        except ValueError:
            return None  # a combination the backend's model refuses

    def _fit(self, cls: type[Loader], start: BaseModel, tuning: BackendTuning) -> BaseModel | None:
        """The start point, its knobs stepped down their value lists (last knob first) until it fits."""
        point = start
        for key in reversed(list(tuning.space)):
            values = tuning.space[key]
            while self.limits.refuses(cls, point, self.config.pipeline):
                current = getattr(point, key)
                lower = values[: values.index(current)] if current in values else values[:1]
                smaller = self._point(cls, point, key, lower[-1]) if lower else None
                if smaller is None:
                    break
                point = smaller
        return None if self.limits.refuses(cls, point, self.config.pipeline) else point

    # -- the hill climb ----------------------------------------------------------------------------

    def _search(self, tuning: BackendTuning, deadline: float, incumbent: Trial | None, seen: set[tuple]) -> None:
        """Climb from the start, whose trial (`incumbent`) ran in the first round."""
        cls = backend_class(tuning.backend)
        if incumbent is None or incumbent.samples_per_s is None:
            tuning.status = RunStatus.ERROR if incumbent is not None else RunStatus.NOT_RUN
            tuning.reason = incumbent.reason if incumbent is not None else "the budget was spent before its first run"
            return
        best_settings = tuning.start
        assert best_settings is not None  # it ran in the first round
        for _ in range(self.window.max_passes):
            moved = False
            for key, values in tuning.space.items():
                for direction in directions(values, getattr(best_settings, key)):
                    for value in direction:
                        point = self._point(cls, best_settings, key, value)
                        if point is None or _key(point) in seen:
                            continue
                        refused = self.limits.refuses(cls, point, self.config.pipeline)
                        if refused:
                            seen.add(_key(point))
                            tuning.refused.append(Refusal(settings=knobs_of(point), reason=refused))
                            continue
                        trial = self._trial(cls, tuning, point, incumbent.samples_per_s, deadline, seen)
                        if trial is None:  # the budget cannot fit another run
                            tuning.best, tuning.best_settings = incumbent, best_settings
                            return
                        gain = 1 + self.window.min_gain
                        rate, best_rate = trial.samples_per_s, incumbent.samples_per_s
                        if trial.outcome == "ok" and rate is not None and best_rate is not None \
                                and rate > best_rate * gain:
                            incumbent, best_settings, moved = trial, point, True
                        elif len(values) > 2 and numeric(values):
                            break  # a numeric knob: past a value that did not help, the next ones are not tried
            if not moved:
                break
        tuning.best, tuning.best_settings = incumbent, best_settings

    def _expected_s(self, tuning: BackendTuning) -> float:
        full = [t.seconds for t in tuning.trials if t.outcome == "ok"]
        return sorted(full)[len(full) // 2] if full else 0.0

    def _trial(self, cls: type[Loader], tuning: BackendTuning, settings: BaseModel, incumbent: float | None,
               deadline: float, seen: set[tuple]) -> Trial | None:
        """One short run of `settings`; None when the budget cannot fit it."""
        now = self.clock()
        if now >= deadline or (tuning.trials and now + self._expected_s(tuning) > deadline):
            return None
        seen.add(_key(settings))
        loader = self._build(cls, settings)
        trial = Trial(knobs_of(settings), _unique_label(f"{tuning.backend} {loader.describe()}", settings, tuning))
        w = self.window
        started = time.perf_counter()
        first: list[float] = []

        def check(done: int) -> None:
            measured = done - w.warmup_batches
            if measured == 0:
                first.append(time.perf_counter())
            if self.clock() >= deadline and done < w.warmup_batches + w.measure_batches:
                raise _Stop("cut by the budget", "the backend's share of the budget ran out")
            if incumbent and measured >= w.min_batches and first:
                rate = (measured * self.config.pipeline.batch_size) / max(time.perf_counter() - first[0], 1e-9)
                if rate < (1 - w.stop_margin) * incumbent:
                    trial.samples_per_s, trial.batches = rate, measured
                    raise _Stop("stopped early", f"{rate:,.0f} samples/s after {measured} batches, below "
                                                 f"{1 - w.stop_margin:.0%} of the best so far ({incumbent:,.0f})")

        if self.reporter is not None:
            self.reporter.run_started(f"tuning {trial.label}", w.warmup_batches + w.measure_batches)
        try:
            result = run_repeat(loader, self.accelerator, DeviceTransfer(self.device, emulate=True), w.warmup_batches,
                                w.measure_batches, on_batch=check)
            trial.samples_per_s = steady_rate(result.probes)
            trial.batches = sum(1 for p in result.probes if p.measured)
        except _Stop as stop:
            trial.outcome, trial.reason = stop.outcome, stop.reason
        except (LoadoptError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - a setting that fails is a setting not to pick
            log.debug("tuning trial %s failed", trial.label, exc_info=True)
            trial.outcome, trial.reason = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            loader.close()
        trial.seconds = time.perf_counter() - started
        tuning.trials.append(trial)
        report = getattr(self.reporter, "tuning_trial", None)
        if report is not None:
            report(trial.label, trial.outcome, trial.samples_per_s, trial.reason)
        return trial

    def _build(self, cls: type[Loader], settings: BaseModel, prepare: bool = False) -> Loader:
        loader = configured_loader(cls.name, self.config, self.dataset, settings, device=self.device)
        try:
            loader.prepare(convert_missing=self.convert if prepare else False)
            if loader.runs_apart:  # a trial runs in this process: a crash on bad bytes would end the whole tuning
                loader.screen_samples()
        except BaseException:
            loader.close()
            raise
        return loader


def steady_rate(probes: list[BatchProbe]) -> float:
    """Samples/s over the last two thirds of the measured batches: a short run's first measured batches
    may still drain what the loader prefetched during warm-up, which flatters deep prefetch."""
    measured = [p for p in probes if p.measured]
    tail = measured[len(measured) // 3 :]
    if not tail:
        return 0.0
    last = tail[-1]
    ended = last.ended_s if last.ended_s is not None else (
        last.start_s + last.wait_s + last.finish_s + last.compute.seconds())  # CUDA: its step, timed on the device
    seconds = ended - tail[0].start_s
    return sum(p.samples for p in tail) / seconds if seconds > 0 else 0.0


def _unique_label(label: str, settings: BaseModel, tuning: BackendTuning) -> str:
    """`describe()` may not show every knob searched: name the ones that tell two trials apart."""
    mine, shown = knobs_of(settings), settings.model_dump()  # compared as recorded, named as the backend holds them
    for trial in tuning.trials:
        if trial.label == label and trial.settings != mine:
            label += "".join(f" {k}={shown[k]}" for k, v in mine.items() if trial.settings.get(k) != v)
    return label


def tuning_summary(tunings: list[BackendTuning], budget_s: float) -> TuningSummary:
    """The tuning trace for results.json."""
    return TuningSummary(method="coordinate-wise hill climbing with early stopping (loadopt/bench/tuner.py)",
                         budget_s=budget_s, seconds=round(sum(t.seconds for t in tunings), 2),
                         backends=[t.record() for t in tunings])
