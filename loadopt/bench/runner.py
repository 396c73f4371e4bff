"""`run_bench`: every configured loader setting through the harness, ranked, written to disk.

Repeats are interleaved (repeat 1 of every setting, then repeat 2, ...) so that a slow phase of a
shared, noisy machine does not land on one setting only. A backend that cannot run here is listed
with its reason; a backend that fails at run time is listed with its error and the bench goes on;
Ctrl-C stops the bench and keeps the runs already finished.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from loadopt import recipe
from loadopt.bench import attribution, decision, stages, tuner
from loadopt.bench import ceilings as ceiling_measures
from loadopt.bench.accelerator import make_accelerator
from loadopt.bench.decision import decision_path  # noqa: F401 - where auto's decisions live, kept importable here
from loadopt.bench.harness import RepeatResult, run_repeat
from loadopt.bench.metrics import aggregate, median
from loadopt.bench.monitor import MachineLoad, load_note
from loadopt.bench.results import (
    SCHEMA_VERSION,
    machine_fingerprint,
    machine_info,
    prepare_output,
    write_results,
)
from loadopt.config import Config, WorkloadConfig, backend_settings
from loadopt.device import DeviceTransfer, resolve_device
from loadopt.errors import LoadoptError, StorageError, Terminated
from loadopt.loaders.base import backend_class, backend_for
from loadopt.storage.imagefolder import ImageDataset, open_dataset
from loadopt.storage.pagecache import evict
from loadopt.storage.remote import redact
from loadopt.storage.tier_reads import bytes_source
from loadopt.storage.tiers import (
    counters_delta,
    resolve_tier,
    sum_counters,
    tier_counters,
    tier_failure,
    tier_label,
)
from loadopt.storage.tokens import TokenDataset

log = logging.getLogger(__name__)


class Reporter:
    """Progress callbacks of a bench; the CLI draws them with rich, the library ignores them."""

    def dataset_progress(self, done: int, total: int) -> None: ...

    def conversion_progress(self, label: str, done: int, total: int) -> None: ...

    def run_started(self, label: str, total_batches: int) -> None: ...

    def batch_done(self, done: int) -> None: ...

    def run_finished(self, label: str, metrics: dict[str, Any] | None, error: str | None) -> None: ...


@dataclass
class _Setting:
    backend: str
    settings: BaseModel | None
    label: str
    status: str = "ok"  # ok | unavailable | error
    reason: str = ""
    repeats: list[RepeatResult] = field(default_factory=list)
    tier_counters: list[dict[str, float]] = field(default_factory=list)  # per repeat: retries, faults, ...


@dataclass
class BenchOutcome:
    results: dict[str, Any]
    json_path: Path
    parquet_path: Path
    interrupted: bool


def effective_workload(workload: WorkloadConfig, quick: bool) -> WorkloadConfig:
    """`--quick`: one short repeat per setting, for a first look in well under two minutes."""
    if not quick:
        return workload
    return workload.model_copy(update={"warmup_batches": min(workload.warmup_batches, 2),
                                       "measure_batches": min(workload.measure_batches, 20), "repeats": 1})


def _plan(config: Config, names: list[str], dataset: ImageDataset, device, reporter: Reporter,
          convert: bool) -> list[_Setting]:
    plan: list[_Setting] = []
    for name in names:
        cls = backend_for(name, f"--loaders {name}")
        available, reason = cls.available()
        if not available:
            plan.append(_Setting(name, None, name, "unavailable", reason))
            continue
        for settings in backend_settings(config, name):
            probe = cls(dataset, config.pipeline, settings, device=device, seed=config.seed)
            label = f"{name} {probe.describe()}"
            try:
                probe.prepare(lambda done, total, label=label: reporter.conversion_progress(label, done, total),
                              convert)
            except StorageError as exc:  # the tier failed its converted files' reads: this setting's error
                plan.append(_Setting(name, settings, label, "error", str(exc).splitlines()[0]))
                continue
            finally:
                probe.close()
            plan.append(_Setting(name, settings, label))
    return plan


def run_bench(config: Config, *, loaders: list[str] | None = None, out: str | None = None, quick: bool = False,
              reporter: Reporter | None = None, convert: bool = True, attribute: bool = True, tune: bool = False,
              budget_s: float = 600.0, attribute_stages: bool = False) -> BenchOutcome:
    """Measure every configured loader setting; write results.json and timings.parquet into `out`.

    A backend that reads its own format converts the dataset first (once, cached) unless `convert`
    is false, in which case a missing conversion is an error. `attribute` (default) also measures the
    machine's ceilings (a few seconds) and attributes each setting's bottleneck (bench/attribution.py).
    `tune` first searches each backend's knobs within `budget_s` seconds (bench/tuner.py) and then
    measures each backend's best setting; `attribute_stages` (implied by `tune`) runs the stages of each
    backend's best setting apart: loader warm and cold, storage read, decode + transform (bench/stages.py)."""
    from loadopt.bench import distributed

    if distributed.launched():  # under torchrun: one emulated accelerator per rank (bench/distributed.py)
        return distributed.run_bench_distributed(config, loaders=loaders, out=out, quick=quick, reporter=reporter,
                                                 convert=convert)
    reporter = reporter or Reporter()
    folder = prepare_output(out or config.report.out)
    device = resolve_device(config.workload.device)
    workload = effective_workload(config.workload, quick)
    dataset = open_dataset(config, progress=reporter.dataset_progress)
    tunings = None
    if tune:  # the search's trials, then each backend's best setting measured as any configured one
        tunings = tuner.Tuner(config, dataset, device, budget_s, reporter=reporter, convert=convert).tune(
            loaders or list(config.loaders))
        plan = [_Setting(t.backend, t.best_settings, t.best.label, "ok") if t.best is not None else
                _Setting(t.backend, None, t.backend, t.status if t.status != "ok" else "error", t.reason)
                for t in tunings]
    else:
        plan = _plan(config, loaders or list(config.loaders), dataset, device, reporter, convert)
    accelerator = make_accelerator(workload.model, workload.step_time_ms, len(dataset.classes), device)
    cache_note = "warm: the page cache was left as it was"
    interrupted = False
    user_error: LoadoptError | None = None
    ceilings: dict[str, Any] | None = None
    machine_load = MachineLoad().start()  # results.json `machine.load`: is the machine busy with other work?
    try:
        if attribute and any(s.status == "ok" for s in plan):
            # The decode ceiling runs as many worker processes as the busiest setting (bench/parallel.py).
            workers = max(backend_class(s.backend).cpu_demand(s.settings) for s in plan if s.status == "ok")
            ceilings = ceiling_measures.measure_ceilings(config, dataset, device, workers)
        for repeat in range(workload.repeats):
            for setting in plan:
                if setting.status != "ok":
                    continue
                cache_note = _run_one(setting, repeat, config, dataset, device, accelerator, workload,
                                      reporter) or cache_note
        if ceilings is not None:  # measured again after the runs: the higher of the two is kept
            ceilings = ceiling_measures.keep_best(ceilings, config, dataset)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where the caller made it one (errors.Terminated)
        interrupted = True
        stopped_by = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    except LoadoptError as exc:
        user_error = exc
    results = _results(config, plan, dataset, device, workload, quick, interrupted, cache_note)
    if interrupted:
        results["interrupted_by"] = stopped_by
    results["machine"]["load"] = machine_load.stop()
    if tunings is not None:
        results["tuning"] = tuner.tuning_summary(tunings, budget_s)
        tried = {t.backend: (len(t.trials), t.space_size, t.reason) for t in tunings}
        for run in results["runs"]:
            count, size, note = tried[run["backend"]]
            run["tuned"] = {"tried": count, "space_size": size, "note": note}
    if ceilings is not None:
        try:
            _attribute(results, ceilings)
            if (tune or attribute_stages) and not interrupted and user_error is None:
                stages.attribute_stages(config, dataset, device, results, ceilings, reporter)
        except KeyboardInterrupt as exc:
            interrupted = results["interrupted"] = True
            results["interrupted_by"] = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        except Exception:  # noqa: BLE001 - the measured runs must reach the disk whatever the attribution does
            log.warning("bottleneck attribution failed; the results are written without it", exc_info=True)
    if not interrupted and user_error is None:
        tier = decision.storage_tier(tier_label(config.storage.tier), dataset.root)  # a name: never the options
        results["decision"] = decision.make_decision(results, tier)
    json_path, parquet_path = write_results(folder, results, _timing_rows(plan))
    if user_error is not None:
        raise user_error
    if results.get("decision"):
        decision.record(results["decision"], folder)
    return BenchOutcome(results, json_path, parquet_path, interrupted)


def skipped_files(per_repeat) -> list[dict[str, Any]]:
    """One entry per unreadable file (path, what was wrong, how many times a repeat met it): a file
    met in every epoch of every repeat is still one file."""
    files: dict[str, dict[str, Any]] = {}
    for skipped in per_repeat:
        for path, why in skipped:
            files.setdefault(path, {"path": path, "reason": why, "times": 0})["times"] += 1
    return list(files.values())


def _evict(files: list[str]) -> str:
    if not files:
        return "cold requested, but the data is not on a local disk: its cache could not be evicted"
    count = evict(files)
    return (f"cold: the files each loader reads ({count} of {len(files)} for the last run: the source images, "
            "or a backend's converted files) evicted from the page cache (posix_fadvise DONTNEED) before each run")


def setting_loader(config: Config, setting: _Setting, dataset, device, rank: int = 0, world_size: int = 1):
    """The loader of one planned setting (for one rank under torchrun), opened: it was converted when
    planned, and opening it is not timed."""
    loader = backend_class(setting.backend)(dataset, config.pipeline, setting.settings, device=device,
                                            seed=config.seed, rank=rank, world_size=world_size,
                                            on_error=config.dataset.on_error)
    try:
        loader.prepare(convert_missing=False)
    except BaseException:
        loader.close()
        raise
    return loader


def _run_one(setting: _Setting, repeat: int, config: Config, dataset: ImageDataset, device, accelerator,
             workload: WorkloadConfig, reporter: Reporter) -> str | None:
    """One repeat of one setting; returns the cache note when the page cache was evicted first."""
    reporter.run_started(f"{setting.label} (repeat {repeat + 1}/{workload.repeats})",
                         workload.warmup_batches + workload.measure_batches)
    loader = None
    counters = tier_counters(dataset.fs)
    try:
        loader = setting_loader(config, setting, dataset, device)
        # Cold: evict what this loader reads (the JPEGs, or the Arrow file / raw shards it converted to).
        note = _evict(loader.storage_files()) if config.storage.cache == "cold" else None
        result = run_repeat(loader, accelerator, DeviceTransfer(device, emulate=True), workload.warmup_batches,
                            workload.measure_batches, on_batch=reporter.batch_done)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - one failing backend (or a failing tier) must not take the others down
        recorded = _tier_delta(setting, counters, dataset)
        failure = tier_failure(exc, dataset.fs, setting.tier_counters[-1] if recorded else None)
        if isinstance(exc, LoadoptError) and failure is None:
            raise
        log.debug("run %s failed", setting.label, exc_info=True)
        setting.status, setting.reason = "error", str(failure or f"{type(exc).__name__}: {exc}").splitlines()[0]
        reporter.run_finished(setting.label, None, setting.reason)
        return None
    finally:
        if loader is not None:
            loader.close()
    _tier_delta(setting, counters, dataset)
    setting.repeats.append(result)
    reporter.run_finished(setting.label, result.metrics, None)
    return note


def _tier_delta(setting: _Setting, before: dict[str, float] | None, dataset: ImageDataset) -> bool:
    """Record what this repeat added to the tier's counters (shared by the loader's processes)."""
    delta = counters_delta(before, tier_counters(dataset.fs))
    if delta is not None:
        setting.tier_counters.append(delta)
    return delta is not None


def _results(config: Config, plan: list[_Setting], dataset: ImageDataset, device, workload: WorkloadConfig,
             quick: bool, interrupted: bool, cache_note: str) -> dict[str, Any]:
    machine = machine_info()
    runs = []
    for setting in plan:
        run: dict[str, Any] = {"backend": setting.backend, "label": setting.label,
                               "settings": setting.settings.model_dump() if setting.settings else None,
                               "status": setting.status, "reason": setting.reason,
                               "bytes_source": bytes_source(dataset),
                               "recipe": _recipe_of(setting, config, dataset)}
        if setting.repeats and setting.status == "ok":
            run["metrics"] = aggregate([r.metrics for r in setting.repeats])
            run["repeats"] = [r.metrics for r in setting.repeats]
            run["skipped_files"] = skipped_files(r.skipped for r in setting.repeats)
        elif setting.status == "ok":
            run["status"], run["reason"] = "not run", "the bench was interrupted first"
        if setting.tier_counters:  # reads, retries and faults of the storage tier, over every repeat
            run["tier_counters"] = sum_counters(setting.tier_counters)
        runs.append(run)
    measured = sorted((r for r in runs if "metrics" in r), key=lambda r: -median(r["metrics"], "samples_per_s"))
    want = recipe.wanted(config.pipeline, tokens=isinstance(dataset, TokenDataset))
    # "fastest" among the settings that deliver the config's training input (loadopt.recipe)
    summary = _summary([r for r in measured if not recipe.differences(r.get("recipe"), want)] or measured)
    return {
        "schema_version": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "loadopt bench",
        "config_source": config.source,
        "config": redact(config.model_dump(mode="json")),
        "quick": quick,
        "interrupted": interrupted,
        "device": str(device),
        "machine": machine,
        "machine_fingerprint": machine_fingerprint(machine),
        "tier": resolve_tier(config.storage.tier).redacted(),
        "dataset": {"root": redact(dataset.root), "fingerprint": dataset.fingerprint, "synthetic": dataset.synthetic,
                    "num_samples": len(dataset), "num_classes": len(dataset.classes),
                    "total_bytes": int(dataset.sizes.sum()), "mean_sample_bytes": float(dataset.sizes.mean())},
        "workload": workload.model_dump(),
        "cache": {"mode": config.storage.cache, "note": cache_note},
        "recipe": want,  # the config's
        "runs": runs,
        "ranking": [r["label"] for r in measured],
        "summary": summary,
    }


def _recipe_of(setting: _Setting, config: Config, dataset) -> dict[str, Any] | None:
    """The recipe a setting delivers (`loadopt.recipe`), from a loader built but never prepared."""
    if setting.settings is None:
        return None
    try:
        return backend_class(setting.backend)(dataset, config.pipeline, setting.settings, seed=config.seed).recipe()
    except LoadoptError:
        return None


def _attribute(results: dict[str, Any], ceilings: dict[str, Any]) -> None:
    """Each measured run against the ceiling that bounds it; a verdict for each backend's best setting."""
    results["ceilings"] = ceilings
    by_label = {r["label"]: r for r in results["runs"]}
    verdicts, seen = [], set()
    for label in results["ranking"]:  # fastest first: the first of a backend is its best setting
        run = by_label[label]
        found = attribution.attribute(run["metrics"], label, ceilings, ceilings["job"], run["settings"],
                                      run.get("recipe"))
        run["ceiling"] = found["ceiling"]
        capacity, rate = found["ceiling"]["samples_per_s"], median(run["metrics"], "samples_per_s")
        attribution.hold_to_ceiling(run, rate, capacity, results["machine"].get("load"))
        if run["backend"] not in seen:
            seen.add(run["backend"])
            busy = load_note(results["machine"].get("load"))
            verdicts.append({"label": label, "bottleneck": found["bottleneck"],
                             "text": found["text"] + (f"; {busy}" if busy else "")})
    results["verdicts"] = verdicts


def _summary(measured: list[dict[str, Any]]) -> str:
    if not measured:
        return "no loader setting was measured"
    best = measured[0]
    rate = median(best["metrics"], "samples_per_s")
    text = f"fastest: {best['label']} at {rate:,.0f} samples/s"
    if len(measured) > 1:
        second = measured[1]
        other = median(second["metrics"], "samples_per_s")
        text += f", {rate / other:.2f}x the next ({second['label']}, {other:,.0f} samples/s)" if other else ""
    return text


def _timing_rows(plan: list[_Setting]) -> dict[str, list]:
    columns = ("run", "backend", "label", "repeat", "batch", "measured", "start_s", "wait_s", "h2d_s",
               "finish_s", "compute_s", "samples", "sample_bytes")
    rows: dict[str, list] = {c: [] for c in columns}
    for run_index, setting in enumerate(plan):
        for repeat, result in enumerate(setting.repeats):
            for p in result.probes:
                values = (run_index, setting.backend, setting.label, repeat, p.index, p.measured, p.start_s,
                          p.wait_s, p.h2d.seconds(), p.finish_s, p.compute.seconds(), p.samples, p.sample_bytes)
                for column, value in zip(columns, values, strict=True):
                    rows[column].append(value)
    return rows
