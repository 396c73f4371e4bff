"""`run_bench`: every configured loader setting through the harness, ranked, written to disk.

Repeats are interleaved (repeat 1 of every setting, then repeat 2, ...) so that a slow phase of a
shared, noisy machine does not land on one setting only. A backend that cannot run here is listed
with its reason; a backend that fails at run time is listed with its error and the bench goes on;
Ctrl-C stops the bench and keeps the runs already finished. Under `torchrun` every rank runs this same
loop, each on its shard with an all-reduce per step; what differs is behind `distributed.Ranks`: what
rank 0 does alone, the per-step collective, the gather of each run. A backend whose native code can crash
the process on bad bytes (`runs_apart`: DALI) runs each setting in a forked child on one CPU rank, so its crash
is that setting's error; results.json is rewritten after every setting.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadopt.bench import decision, distributed, tuner
from loadopt.bench.accelerator import make_accelerator
from loadopt.bench.attribution import ceilings as ceiling_measures
from loadopt.bench.attribution import stages
from loadopt.bench.attribution import verdicts as attribution
from loadopt.bench.decision import decision_path  # noqa: F401 - where auto's decisions live, kept importable here
from loadopt.bench.harness import NothingDelivered, RepeatResult, run_repeat
from loadopt.bench.metrics import median
from loadopt.bench.monitor import MachineLoad, load_note
from loadopt.bench.rank_report import RankReport
from loadopt.bench.results_document import Setting, results_document, timing_rows
from loadopt.bench.results_files import archive_previous, discard_stale_files, write_results
from loadopt.config import backend_settings
from loadopt.config_models import Config, WorkloadConfig
from loadopt.device import DeviceTransfer, Elapsed
from loadopt.errors import LoadoptError, OutputError, StorageError, Terminated, WorkerDied, stop_behind
from loadopt.files import discard_output, prepare_output
from loadopt.loaders.registry import backend_class, backend_for, configured_loader
from loadopt.loaders.sample_transform import SampleTransform
from loadopt.progress import Reporter
from loadopt.schema.ceilings import Ceilings, Verdict
from loadopt.schema.documents import ResultsFile, RunStatus, RunTuned, as_dict
from loadopt.storage.dataset import Dataset
from loadopt.storage.open import open_dataset
from loadopt.storage.tiers.pagecache import evict_for_cold
from loadopt.storage.tiers.spec import tier_label
from loadopt.storage.tiers.stack import counters_delta, sum_counters, tier_counters, tier_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchRequest:
    """What a bench was asked to do (`run_bench`'s arguments), handed down as one value."""

    config: Config
    names: list[str]  # the backends to run, in the config's order or `--loaders`'
    out: str | None  # the results folder; None: the config's report.out
    quick: bool
    reporter: Reporter
    convert: bool  # convert a missing stored form (else a missing conversion is an error)
    attribute: bool  # measure the ceilings and attribute each setting's bottleneck
    tune: bool  # search each backend's knobs within budget_s first
    budget_s: float
    attribute_stages: bool  # run each backend's best setting's stages apart
    relist: bool = False  # list the dataset again (`--relist`) instead of reading its saved listing
    # A stop that came but whose exception was lost (raised inside a finaliser or a thread, which Python ignores):
    # the exception to raise at the next setting's boundary, else None (the CLI's signal handlers know).
    stop_requested: Callable[[], BaseException | None] = lambda: None


@dataclass
class BenchOutcome:
    results: ResultsFile | None  # None on a rank other than 0 under torchrun (rank 0 writes)
    # None where nothing was written: on a rank other than 0 under torchrun (rank 0 writes), or when no
    # setting was measured (every one unavailable or failing: the output folder is left as it was)
    json_path: Path | None
    parquet_path: Path | None
    interrupted: bool
    rank: int = 0
    # The user error that stopped the bench after some runs (only with `run_bench(return_errors=True)`;
    # otherwise raised): the runs measured before it are written, the settings after it say so.
    error: LoadoptError | None = None

    def document(self) -> dict[str, Any]:
        """The results as plain JSON-shaped data (`as_dict`: the keys results.json has), for the readers of
        its open sections; on a rank other than 0, only the rank."""
        return as_dict(self.results) if self.results is not None else {"rank": self.rank}


def effective_workload(workload: WorkloadConfig, quick: bool) -> WorkloadConfig:
    """`--quick`: one short repeat per setting, for a first look in well under two minutes."""
    if not quick:
        return workload
    return workload.model_copy(update={"warmup_batches": min(workload.warmup_batches, 2),
                                       "measure_batches": min(workload.measure_batches, 20), "repeats": 1})


def _plan(config: Config, names: list[str], dataset: Dataset, device, reporter: Reporter,
          convert: bool, world_size: int = 1) -> list[Setting]:
    plan: list[Setting] = []
    for name in names:
        cls = backend_for(name, f"--loaders {name}")
        available, reason = cls.available()
        if available:  # and it reads this kind of dataset (Loader.supports)
            available, reason = cls.supports(dataset)
        if not available:
            plan.append(Setting(name, None, name, RunStatus.UNAVAILABLE, reason))
            continue
        for settings in backend_settings(config, name):
            runs, why_not = cls.runs_pipeline(config.pipeline, settings)
            if not runs:
                plan.append(Setting(name, settings, name, RunStatus.UNAVAILABLE, why_not))
                continue
            probe = configured_loader(name, config, dataset, settings, device=device)
            label = f"{name} {probe.describe()}"
            try:
                probe.prepare(functools.partial(reporter.conversion_progress, label), convert)
                label = f"{name} {probe.describe()}"  # a refused upload keeps the conversion local: not via tier
                screen_where_kept_here(probe, device, world_size,
                                       functools.partial(reporter.conversion_progress, f"{label}: screening"))
            except StorageError as exc:  # the tier failed its converted files' reads: this setting's error
                plan.append(Setting(name, settings, label, RunStatus.ERROR, str(exc).splitlines()[0]))
                continue
            finally:
                probe.close()
            plan.append(Setting(name, settings, label))
    return plan


def run_bench(config: Config, *, loaders: list[str] | None = None, out: str | None = None, quick: bool = False,
              reporter: Reporter | None = None, convert: bool = True, attribute: bool = True, tune: bool = False,
              budget_s: float = 600.0, attribute_stages: bool = False, return_errors: bool = False,
              relist: bool = False, stop_requested: Callable[[], BaseException | None] | None = None) -> BenchOutcome:
    """Measure every configured loader setting; write results.json and timings.parquet into `out`.

    A backend that reads its own format converts the dataset first (once, cached) unless `convert`
    is false, in which case a missing conversion is an error. `attribute` (default) also measures the
    machine's ceilings (a few seconds) and attributes each setting's bottleneck.
    `tune` first searches each backend's knobs within `budget_s` seconds and then
    measures each backend's best setting; `attribute_stages` (implied by `tune`) runs the stages of each
    backend's best setting apart: loader warm and cold, storage read, decode + transform.

    The folder `out` is only written once a setting was measured: a bench that measured nothing (every
    setting unavailable or failing, a user error or an interrupt before the first run finished) leaves it
    as it was. One that measured part writes what it measured, each setting not run with the reason; a
    user error then is raised after the writing, or returned in `BenchOutcome.error` with
    `return_errors` (the CLI, which prints the runs and writes the report before the error). `relist` lists
    the dataset again and saves the new listing. `stop_requested` says whether a
    stop came whose exception got lost (it is honoured at the next setting's boundary).

    From the first measured setting on, results.json and timings.parquet are rewritten after every setting
    (marked `in_progress: true` until the bench ends), so a crash of the process keeps what was measured; the
    report and decision an earlier bench left in `out` are removed then, as they describe other runs."""
    if attribute:
        ceiling_measures.ceiling_seconds()  # a bad $LOADOPT_CEILING_SECONDS: its one line before any work
    for name in loaders or list(config.loaders):  # a misspelt --loaders, before any dataset is made or converted
        backend_for(name, f"--loaders {name}")
    SampleTransform.of_pipeline(config.pipeline)  # the job's transform imports, or one line says why not
    # How long a rank may wait for the others: rank 0 alone generates, converts, tunes and measures ceilings.
    timeout_s = 1800.0 + (budget_s if tune else 0.0)
    with distributed.ranks_here(config.workload.device, timeout_s) as ranks:
        request = BenchRequest(config, loaders or list(config.loaders), out, quick,
                               (reporter if ranks.lead else None) or Reporter(), convert, attribute, tune, budget_s,
                               attribute_stages, relist, stop_requested or (lambda: None))
        outcome = _bench(request, ranks)
    if outcome.error is not None and not return_errors:
        raise outcome.error
    return outcome


def _bench(request: BenchRequest, ranks: distributed.Ranks) -> BenchOutcome:
    requested = Path(request.out or request.config.report.out).expanduser()
    existed = requested.exists()
    folder = ranks.alone(lambda: prepare_output(requested))
    try:
        outcome = _measure(request, ranks, folder)
    except BaseException:
        if ranks.lead:
            discard_output(folder, existed)
        raise
    if ranks.lead and outcome.json_path is None:  # nothing measured, nothing written
        discard_output(folder, existed)
    return outcome


@dataclass
class _Pass:
    """How the plan's runs went: the ceilings measured around them, the page cache's state, and whether
    (and by what) the pass was stopped."""

    ceilings: Ceilings | None = None
    cache_note: str = "warm: the page cache was left as it was"
    interrupted: bool = False
    stopped_by: str = "SIGINT"
    user_error: LoadoptError | None = None

    def not_run(self) -> str:
        """Why a setting the pass did not reach has no run."""
        if self.interrupted:
            return f"the bench was interrupted ({self.stopped_by}) before this setting finished a run"
        if self.user_error is not None:
            stop = (str(self.user_error).splitlines() or [type(self.user_error).__name__])[0]
            return f"the bench stopped at an error before this setting ran: {stop}"
        return ""


def _measure(request: BenchRequest, ranks: distributed.Ranks, folder: Path) -> BenchOutcome:
    config = request.config
    workload = effective_workload(config.workload, request.quick)
    # Rank 0 lists again where asked; the others, opening after it, read the listing it saved.
    dataset = ranks.first(lambda: open_dataset(config, progress=request.reporter.dataset_progress,
                                               relist=request.relist and ranks.lead))
    tunings = None
    if request.tune:  # the search's trials, then each backend's best setting measured as any configured one
        tunings = ranks.alone(lambda: tuner.Tuner(config, dataset, ranks.device, request.budget_s,
                                                  reporter=request.reporter, convert=request.convert,
                                                  limits=ranks.limits()).tune(request.names))
        plan = [Setting(t.backend, t.best_settings, t.best.label, RunStatus.OK) if t.best is not None else
                Setting(t.backend, None, t.backend, t.status if t.status != RunStatus.OK else RunStatus.ERROR,
                        t.reason)
                for t in tunings]
    else:
        plan = ranks.alone(lambda: _plan(config, request.names, dataset, ranks.device, request.reporter,
                                         request.convert, ranks.world_size))
    machine_load = MachineLoad().start() if ranks.lead else None  # results.json `machine.load`: a busy machine?
    progress = _Progress(request, folder, plan, dataset, workload, ranks.device) if ranks.lead else None
    done = _run_plan(request, ranks, plan, dataset, workload, progress)
    load = machine_load.stop() if machine_load is not None else None
    if not ranks.lead or machine_load is None:  # a rank other than 0: rank 0 writes and prints
        if done.user_error is not None:
            raise done.user_error
        return BenchOutcome(None, None, None, done.interrupted, ranks.rank)
    results = results_document(config, plan, dataset, ranks.device, workload, request.quick, done.interrupted,
                               done.cache_note, done.not_run())
    ranks.annotate(results)  # the ranks' figures
    if done.interrupted:
        results.interrupted_by = done.stopped_by
    if results.machine is not None:
        results.machine["load"] = load
    if tunings is not None:
        results.tuning = tuner.tuning_summary(tunings, request.budget_s)
        tried = {t.backend: RunTuned(tried=len(t.trials), space_size=t.space_size, note=t.reason) for t in tunings}
        for run in results.runs:
            run.tuned = tried[run.backend]
    if not results.ranking:  # nothing measured: nothing in the folder is replaced
        if done.user_error is not None:
            raise done.user_error
        if done.interrupted:
            raise Terminated() if done.stopped_by == "SIGTERM" else KeyboardInterrupt()
        return BenchOutcome(results, None, None, False)  # every setting unavailable or failing: the reasons
    if ranks.lead and (progress is None or not progress.started):  # no write of this bench moved the last run aside
        _archive(folder)
    return _write(request, ranks, folder, plan, dataset, results, done)


def _run_plan(request: BenchRequest, ranks: distributed.Ranks, plan: list[Setting], dataset: Dataset,
              workload: WorkloadConfig, progress: _Progress | None = None) -> _Pass:
    """The ceilings, then every repeat of every runnable setting (interleaved), until the end or a stop."""
    config, done = request.config, _Pass()
    accelerator = ranks.step_sync(make_accelerator(workload.model, workload.step_time_ms, len(dataset.classes),
                                                   ranks.device))
    try:
        if request.attribute and any(s.status == RunStatus.OK for s in plan):
            # The decode ceiling runs as many worker processes as the busiest setting.
            workers = max(backend_class(s.backend).cpu_demand(s.settings) for s in plan if s.status == RunStatus.OK)
            if ranks.lead:  # a few seconds with nothing else to show: said, so a terminal is not silent
                request.reporter.line("measuring this machine's ceilings (decode, crop + resize, memory copy, "
                                      "storage read) before the runs")
            done.ceilings = ranks.alone(lambda: ceiling_measures.measure_ceilings(config, dataset, ranks.device,
                                                                                  ranks.decode_workers(workers)))
        for repeat in range(workload.repeats):
            for setting in plan:
                if setting.status != RunStatus.OK:
                    continue
                _honour_stop(request)
                done.cache_note = _run_one(setting, repeat, config, dataset, ranks, accelerator, workload,
                                           request.reporter) or done.cache_note
                if progress is not None:
                    progress.write(done.cache_note)
                _honour_stop(request)  # a stop that landed in the loader's close (or a finaliser) and was lost
        if done.ceilings is not None and ranks.lead:  # measured again after the runs: the higher one is kept
            request.reporter.line("measuring the ceilings again after the runs (the higher of the two is kept)")
            done.ceilings = ceiling_measures.keep_best(done.ceilings, config, dataset)
        _honour_stop(request)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where the caller made it one (errors.Terminated)
        done.interrupted = True
        done.stopped_by = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    except LoadoptError as exc:
        done.user_error = exc
    return done


def _honour_stop(request: BenchRequest) -> None:
    """Raise the stop (KeyboardInterrupt, or `Terminated` for SIGTERM) that came but whose own raise was lost."""
    stop = request.stop_requested()
    if stop is not None:
        raise stop


class _Progress:
    """results.json and timings.parquet rewritten after every setting (each file temp then rename), marked
    `in_progress`, from the first measured setting on: a crash of the process keeps what was measured."""

    def __init__(self, request: BenchRequest, folder: Path, plan: list[Setting], dataset: Dataset,
                 workload: WorkloadConfig, device) -> None:
        self.request, self.folder, self.plan, self.dataset, self.workload = request, folder, plan, dataset, workload
        self.device = device
        self.started = False  # whether the folder holds this bench's files yet

    def write(self, cache_note: str) -> None:
        if not any(s.repeats for s in self.plan):  # nothing measured: the folder stays as it was
            return
        request = self.request
        results = results_document(request.config, self.plan, self.dataset, self.device,
                                   self.workload, request.quick, False, cache_note, IN_PROGRESS_NOT_RUN,
                                   described=False)
        results.in_progress = True  # type: ignore[attr-defined]  # an extra key: results.json allows them
        if not self.started:
            _archive(self.folder)
        try:
            write_results(self.folder, results, timing_rows(self.plan))
        except LoadoptError as exc:  # the final write says it in its line; the bench goes on
            log.warning("could not save the runs so far: %s", exc)
            return
        if not self.started:
            self.started = True
            _discard_stale(self.folder)


def _archive(folder: Path) -> None:
    moved = archive_previous(folder)
    if moved is not None:
        log.info("the earlier bench's results in %s moved to %s", folder, moved)


def _discard_stale(folder: Path) -> None:
    left = discard_stale_files(folder)
    if left:
        log.warning("could not remove the earlier bench's %s in %s", ", ".join(left), folder)


IN_PROGRESS_NOT_RUN = "the bench was still running when this file was written"


def _write(request: BenchRequest, ranks: distributed.Ranks, folder: Path, plan: list[Setting], dataset: Dataset,
           results: ResultsFile, done: _Pass) -> BenchOutcome:
    """Attribute the measured settings, decide (a stopped bench: among what it measured, marked partial),
    write the files."""
    config, interrupted = request.config, done.interrupted
    if done.ceilings is not None:  # what the attribution adds is kept, also where it was cut short
        try:
            _attribute(results, ranks.job_ceilings(done.ceilings))
            if (request.tune or request.attribute_stages) and not interrupted and done.user_error is None:
                stages.attribute_stages(config, dataset, ranks.device, results, done.ceilings, request.reporter)
        except KeyboardInterrupt as exc:
            interrupted = results.interrupted = True
            results.interrupted_by = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        except Exception:  # noqa: BLE001 - the measured runs must reach the disk whatever the attribution does
            log.warning("bottleneck attribution failed; the results are written without it", exc_info=True)
    tier = decision.storage_tier(tier_label(config.storage.tier), dataset.root)  # a name: never the options
    made = decision.make_decision(results, tier)
    if interrupted or done.user_error is not None:
        if made is not None:  # among what was measured, saying what was not
            results.decision = made = decision.partial(made, results)
    else:
        results.decision = made  # None: nothing of the config's recipe was measured
    json_path, parquet_path = write_results(folder, results, timing_rows(plan))
    _discard_stale(folder)  # the earlier bench's report and decision describe other runs
    # A bench that decided nothing leaves no decision of an earlier bench beside its results.
    error = done.user_error
    try:
        decision.record_beside(made, folder)
    except OutputError as exc:  # the results are written: the line comes after them, as a user error's does
        error = error or exc
    return BenchOutcome(results, json_path, parquet_path, interrupted, error=error)


def _evict(files: list[str]) -> str:
    if not files:
        return "cold requested, but the data is not on a local disk: its cache could not be evicted"
    count, left = evict_for_cold(files)
    stayed = f"; {left / 1e6:,.1f} MB stayed cached for the last run (mapped by a live process)" if left else ""
    return (f"cold: the files each loader reads ({count} of {len(files)} for the last run: the source images, "
            "or a backend's converted files) evicted from the page cache (posix_fadvise DONTNEED) before each run"
            f"{stayed}")


def setting_loader(config: Config, setting: Setting, dataset, device, rank: int = 0, world_size: int = 1,
                   screen: bool = False):
    """The loader of one planned setting (for one rank under torchrun), opened: it was converted when
    planned, and opening it is not timed. `screen`: it sees only the samples it checked first."""
    loader = configured_loader(setting.backend, config, dataset, setting.settings, device=device, rank=rank,
                               world_size=world_size)
    try:
        loader.prepare(convert_missing=False)
        if screen:
            loader.screen_samples()
        else:
            screen_where_kept_here(loader, device, world_size)
    except BaseException:
        loader.close()
        raise
    return loader


def _run_one(setting: Setting, repeat: int, config: Config, dataset: Dataset, ranks: distributed.Ranks,
             accelerator, workload: WorkloadConfig, reporter: Reporter) -> str | None:
    """One repeat of one setting (on every rank); returns the cache note when the page cache was evicted
    first. A failure on any rank is the setting's error on every rank; a user error stops the bench. A
    backend whose native library can crash the process on bad bytes runs in a child process where it can
    (`runs_apart`), so that its crash is this setting's error and not the end of the bench."""
    reporter.run_started(f"{setting.label} (repeat {repeat + 1}/{workload.repeats}{ranks.run_suffix()})",
                         workload.warmup_batches + workload.measure_batches)
    counters = tier_counters(dataset.fs)
    if _runs_apart(setting, ranks):
        measured = _measured_apart(setting, config, dataset, ranks, accelerator, workload, reporter,
                                   screen=setting.crashed is not None)
        if isinstance(measured.error, RunCrashed) and setting.crashed is None:
            # Once more on the samples PIL decodes (checked once, cached): a sample its decoder cannot take is
            # then a named failure under on_error, and the setting has its figures.
            setting.crashed = str(measured.error)
            log.warning("%s: %s; running it again on the samples checked first", setting.label, measured.error)
            reporter.run_started(f"{setting.label} (repeat {repeat + 1}/{workload.repeats}, samples checked first)",
                                 workload.warmup_batches + workload.measure_batches)
            measured = _measured_apart(setting, config, dataset, ranks, accelerator, workload, reporter, screen=True)
    else:
        measured = _measured_here(setting, config, dataset, ranks, accelerator, workload, reporter.batch_done)
    result, note, error = measured.result, measured.note, measured.error
    if result is not None and error is None and not any(p.samples for p in result.probes if p.measured):
        # every sample skipped (dataset.on_error: skip) or none delivered: no figure of a loader, an error
        unreadable = len({path for path, _ in result.skipped})
        error = NothingDelivered(f"delivered no samples ({unreadable} unreadable file(s) skipped under "
                                 "dataset.on_error: skip)" if unreadable else "delivered no samples")
        result = None
    delta = counters_delta(counters, tier_counters(dataset.fs))  # shared by the loader's processes
    report = RankReport(metrics=result.metrics if result else None, skipped=result.skipped if result else [],
                        tier=delta)
    if error is not None:
        failure = tier_failure(error, dataset.fs, delta)
        # The user's to fix: the bench stops; a worker that died (the OOM killer, say) fails this setting only.
        if isinstance(error, LoadoptError) and not isinstance(error, WorkerDied) and failure is None:
            report.fatal = distributed.described(error)
        elif isinstance(error, (RunCrashed, NothingDelivered)):  # already a sentence: no exception name
            report.error = str(error)
        else:
            report.error = str(failure or f"{type(error).__name__}: {error}").splitlines()[0]
    reports = ranks.settle(setting.label, report)
    deltas = [r.tier for r in reports if r.tier is not None]
    if deltas:  # reads, retries and faults of the storage tier, over every rank
        setting.tier_counters.append(sum_counters(deltas))
    for other in reports:
        if other.fatal is not None:  # this setting's error, and the bench stops
            setting.status, setting.reason = RunStatus.ERROR, other.fatal.text if ranks.world_size == 1 else \
                f"rank {other.rank}: {other.fatal.text}"
            if other.rank == ranks.rank and error is not None:
                raise error
            distributed.raise_told(other.fatal, other.rank)
    failed = [r for r in reports if r.error is not None]
    if failed or result is None:
        first = failed[0] if failed else RankReport(rank=ranks.rank, error="no figures")
        setting.status = RunStatus.ERROR
        reason = first.error or "no figures"
        setting.reason = reason if ranks.world_size == 1 else f"rank {first.rank}: {reason}"
        reporter.run_finished(setting.label, None, setting.reason)
        return None
    job = ranks.job_metrics(reports)
    setting.repeats.append(RepeatResult(job, result.probes, [s for r in reports for s in r.skipped]))
    reporter.run_finished(setting.label, job, None)
    return note


class RunCrashed(Exception):
    """The child process a setting ran in died (a native library's crash, a signal): that setting's error."""


@dataclass
class _Measured:
    """What one repeat of one setting gave: its figures, or the exception that stopped it."""

    result: RepeatResult | None = None
    note: str | None = None  # the cache note, where the page cache was evicted first
    error: Exception | None = None


def _runs_apart(setting: Setting, ranks: distributed.Ranks) -> bool:
    """Whether this setting's run goes into a child process: its backend says its native code can crash on
    bad bytes (`runs_apart`), and a fork can carry the run here."""
    return backend_class(setting.backend).runs_apart and \
        can_run_apart(ranks.device, ranks.world_size)


def can_run_apart(device, world_size: int) -> bool:
    """Whether a run can go into a forked child: one rank (a child cannot join the ranks' collective), on the CPU
    (CUDA does not survive a fork)."""
    import multiprocessing

    return world_size == 1 and device.type == "cpu" and "fork" in multiprocessing.get_all_start_methods()


def screen_where_kept_here(loader, device, world_size: int, progress=None) -> None:
    """A backend that would run apart but cannot here (CUDA, torchrun) sees only the samples it screened first
    (`screen_samples`: DALI's, every sample decoded once by PIL, cached), so that bad bytes are a named failure
    and not a crash of the bench."""
    if loader.runs_apart and not can_run_apart(device, world_size):
        loader.screen_samples(progress)


def _measured_here(setting: Setting, config: Config, dataset: Dataset, ranks: distributed.Ranks, accelerator,
                   workload: WorkloadConfig, on_batch, screen: bool = False) -> _Measured:
    """Open the setting's loader (`screen`: on the samples it checked first), evict what it reads where the cache
    is cold, and measure one repeat."""
    loader, measured = None, _Measured()
    try:
        loader = setting_loader(config, setting, dataset, ranks.device, ranks.rank, ranks.world_size, screen)
        # Cold: evict what this loader reads (the JPEGs, or the Arrow file / raw shards it converted to).
        measured.note = _evict(loader.storage_files()) if config.storage.cache == "cold" else None
        ranks.start()
        measured.result = run_repeat(ranks.wrap_loader(loader), accelerator,
                                     DeviceTransfer(ranks.device, emulate=True), workload.warmup_batches,
                                     workload.measure_batches, on_batch=on_batch)
    except KeyboardInterrupt:
        raise
    except distributed.PeerFailed:
        pass  # another rank failed this run: its report says why
    except Exception as exc:  # noqa: BLE001 - one failing backend (or a failing tier) must not take the others down
        stop = stop_behind(exc)
        if stop is not None:  # the stop came while a library was starting, and its cleanup failed over it
            raise stop from None
        log.debug("run %s failed", setting.label, exc_info=True)
        measured.error = exc
        skipped = len({path for path, _ in loader.counters.skipped}) if loader is not None else 0
        if loader is not None and skipped and not loader.counters.samples and not isinstance(exc, NothingDelivered):
            # a loader left with nothing, that failed over it: why first
            measured.error = NothingDelivered(f"delivered no samples ({skipped} unreadable file(s) skipped under "
                                              f"dataset.on_error: skip; then {type(exc).__name__}: {exc})")
    finally:
        if loader is not None:
            loader.close()
    return measured


def _measured_apart(setting: Setting, config: Config, dataset: Dataset, ranks: distributed.Ranks, accelerator,
                    workload: WorkloadConfig, reporter: Reporter, screen: bool = False) -> _Measured:
    """`_measured_here` in a forked child process: a crash there (DALI's decoder on a damaged JPEG, seen
    as a segfault) is this setting's error with its signal; a stop (Ctrl-C, SIGTERM) here ends the child."""
    import multiprocessing
    import signal

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    # Not daemonic: the run may start worker processes of its own (the job's transform on dali), which Python
    # refuses a daemonic process. It ends with this one all the same: killed below on a stop, and on its own
    # when this process is gone (its next message meets a closed pipe).
    child = context.Process(target=_child_measures, daemon=False, name=f"loadopt-run-{setting.backend}",
                            args=(send, setting, config, dataset, ranks, accelerator, workload, screen))
    child.start()
    send.close()
    measured: _Measured | None = None
    try:
        while measured is None:
            try:
                kind, payload = receive.recv()
            except EOFError:  # the child is gone without its answer
                break
            if kind == "batch":
                reporter.batch_done(payload)
            else:
                measured = payload
    finally:
        if measured is None and child.is_alive():  # a stop here, or a child that hung up: it ends with us
            child.kill()
        child.join()
        receive.close()
    if measured is not None:
        return measured
    code = child.exitcode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
    return _Measured(error=RunCrashed(
        f"the {setting.backend} run crashed ({how}) in the child process it ran in; the bench went on without it "
        "(a sample its native decoder could not take? run this backend alone with `make_loader` for its message)"))


def _count_the_waiting_parent(result: RepeatResult) -> None:
    """Add the bench's own process (waiting for this child) to the run's peak memory, as an in-process run's tree
    holds it: the child's tree alone would count the pages it shares with its parent only in part (PSS)."""
    import os

    import psutil

    try:
        parent = psutil.Process(os.getppid()).memory_full_info()
    except (psutil.Error, OSError):
        return
    pss = getattr(parent, "pss", None)
    for key, value in (("peak_rss_mb", parent.rss), ("peak_pss_mb", pss)):
        figure = result.metrics.get(key)
        if isinstance(figure, (int, float)) and value is not None:
            result.metrics[key] = figure + value / 2**20


def _child_measures(send, setting: Setting, config: Config, dataset: Dataset, ranks: distributed.Ranks,
                    accelerator, workload: WorkloadConfig, screen: bool) -> None:
    """The forked child of `_measured_apart`: measure, send the batches done and then what was measured."""
    import pickle
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent ends this child
    # The run goes in a thread of its own: the fork copied the OpenMP team of the parent's main thread without
    # its threads, and torch's first parallel op on this main thread (a batch's torch.cat) waited on them for
    # good. A new thread makes its own team, with the intra-op threads an in-process run has.
    done: list[_Measured] = []
    runner = threading.Thread(target=lambda: done.append(_measured_here(
        setting, config, dataset, ranks, accelerator, workload, lambda count: send.send(("batch", count)), screen)),
        name="loadopt-run")
    runner.start()
    runner.join()
    measured = done[0] if done else _Measured(error=RuntimeError("the run's thread ended without its result"))
    if measured.result is not None:  # the probes' durations as numbers (no device events cross the pipe)
        for probe in measured.result.probes:
            probe.h2d, probe.compute = Elapsed(probe.h2d.seconds()), Elapsed(probe.compute.seconds())
        _count_the_waiting_parent(measured.result)
    try:
        pickle.dumps(measured.error)
    except Exception:  # noqa: BLE001 - an exception that cannot cross the pipe crosses as its line
        measured.error = RuntimeError(f"{type(measured.error).__name__}: {measured.error}")
    send.send(("done", measured))
    send.close()


def _attribute(results: ResultsFile, ceilings: Ceilings) -> None:
    """Each measured run against the ceiling that bounds it; a verdict for each backend's best setting."""
    results.ceilings = ceilings
    load = results.machine.get("load") if results.machine is not None else None
    busy = bool(load and load.get("busy"))
    verdicts: list[Verdict | str] = []
    seen = set()
    for run in results.measured():  # fastest first: the first of a backend is its best setting
        metrics = run.metrics or {}
        found = attribution.attribute(metrics, run.label, ceilings, ceilings.job, run.settings,
                                      run.recipe)
        held = attribution.hold_to_ceiling(found.ceiling, median(metrics, "samples_per_s"), busy)
        run.ceiling, run.fraction_of_ceiling = held.ceiling, held.fraction
        if run.backend not in seen:
            seen.add(run.backend)
            note = load_note(load)
            verdicts.append(Verdict(label=run.label, bottleneck=found.bottleneck,
                                    text=found.text + (f"; {note}" if note else "")))
    results.verdicts = verdicts
