"""The results document of a bench (`results.json`): each planned setting's run, the ranking and the summary
line; and the per-batch rows of `timings.parquet`. (`write_results` writes both files.)"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel

from loadopt import recipe
from loadopt.bench.harness import RepeatResult
from loadopt.bench.metrics import aggregate, median
from loadopt.config_models import Config, WorkloadConfig
from loadopt.errors import LoadoptError
from loadopt.loaders.base import Loader
from loadopt.loaders.registry import configured_loader
from loadopt.machine import machine_fingerprint, machine_info
from loadopt.schema.documents import (
    SCHEMA_VERSION,
    CacheSection,
    DatasetSection,
    ResultsFile,
    Run,
    RunStatus,
    SkippedFile,
    knobs_of,
)
from loadopt.storage.dataset import Dataset
from loadopt.storage.forms.placement import bounded_by_base, bytes_source
from loadopt.storage.remote.access import redact
from loadopt.storage.tiers.spec import resolve_tier
from loadopt.storage.tiers.stack import sum_counters


@dataclass
class Setting:
    """One loader setting of the bench's plan, and what its runs gave."""

    backend: str
    settings: BaseModel | None
    label: str
    status: RunStatus = RunStatus.OK
    reason: str = ""
    repeats: list[RepeatResult] = field(default_factory=list)
    tier_counters: list[dict[str, float]] = field(default_factory=list)  # per repeat: retries, faults, ...
    # Its backend's run crashed on the dataset's bytes (`runs_apart`): its runs see only screened samples since
    crashed: str | None = None


def results_document(config: Config, plan: list[Setting], dataset: Dataset, device, workload: WorkloadConfig,
                     quick: bool, interrupted: bool, cache_note: str, not_run: str = "",
                     described: bool = True) -> ResultsFile:
    """results.json of a bench: every planned setting's run (its metrics over the repeats, or why it has
    none: `not_run` for a setting the bench stopped before, interrupted or at an error), fastest first in
    `ranking`, and the summary line. `described` false (the file a running bench rewrites after each setting)
    leaves each run's recipe and bytes' source out rather than building every setting's loader again."""
    machine = machine_info()
    runs = [_run(setting, config, dataset, not_run, described) for setting in plan]
    measured = sorted((r for r in runs if r.metrics is not None),
                      key=lambda r: -(median(r.metrics or {}, "samples_per_s") or 0.0))
    want = recipe.wanted(config.pipeline, kind=dataset.kind)
    # "fastest" among the settings that deliver the config's training input (loadopt.recipe)
    summary = summary_line([r for r in measured if not recipe.differences(r.recipe, want)] or measured)
    return ResultsFile(
        schema_version=SCHEMA_VERSION,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        command="loadopt bench",
        config_source=config.source,
        config=redact(config.model_dump(mode="json")),
        quick=quick,
        interrupted=interrupted,
        device=str(device),
        machine=machine,
        machine_fingerprint=machine_fingerprint(machine),
        tier=resolve_tier(config.storage.tier).redacted(),
        dataset=DatasetSection(root=redact(dataset.root), format=dataset.source_format,
                               fingerprint=dataset.fingerprint, synthetic=dataset.synthetic,
                               num_samples=len(dataset), num_classes=len(dataset.classes),
                               total_bytes=int(dataset.sizes.sum()), mean_sample_bytes=float(dataset.sizes.mean()),
                               left_out=[redact(note) for note in dataset.left_out]),
        workload=workload.model_dump(),
        cache=CacheSection(mode=config.storage.cache, note=cache_note),
        recipe=want,  # the config's
        runs=runs,
        ranking=[r.label for r in measured],
        summary=summary,
    )


def _run(setting: Setting, config: Config, dataset: Dataset, not_run: str, described: bool = True) -> Run:
    """One planned setting's run: its metrics over the repeats, or why it has none (`not_run`: the bench
    stopped before it); `described`: with its recipe and bytes' source (its loader built to say them)."""
    built = built_loader(setting, config, dataset) if described else None
    run = Run(backend=setting.backend, label=setting.label,
              settings=knobs_of(setting.settings) if setting.settings else None,
              status=setting.status, reason=setting.reason,
              bytes_source=(built.bytes_source() if built else bytes_source(dataset)) if described else None,
              recipe=built.recipe() if built else None)
    if built is not None:
        built.close()
    if setting.repeats and setting.status == RunStatus.OK:
        run.metrics = aggregate([r.metrics for r in setting.repeats])
        run.repeats = [r.metrics for r in setting.repeats]
        run.skipped_files = skipped_files(r.skipped for r in setting.repeats)
    elif setting.status == RunStatus.OK:
        run.status, run.reason = RunStatus.NOT_RUN, not_run or "the bench stopped before this setting ran"
    if setting.tier_counters:  # reads, retries and faults of the storage tier, over every repeat
        run.tier_counters = counters = sum_counters(setting.tier_counters)
        if run.metrics is not None:  # a slower storage under an emulated tier answers for itself, not the tier
            figures = [median(run.metrics, k) for k in ("tier_bytes", "wall_s", "accelerator_utilisation")]
            run.bounded_by_base = bounded_by_base(dataset, counters, *figures)
    return run


def built_loader(setting: Setting, config: Config, dataset) -> Loader | None:
    """A setting's loader built but never prepared, for what it says of itself (the recipe it delivers,
    `loadopt.recipe`; where its bytes come from); None for a setting that has none."""
    if setting.settings is None:
        return None
    try:
        return configured_loader(setting.backend, config, dataset, setting.settings)
    except LoadoptError:
        return None


def summary_line(measured: list[Run]) -> str:
    """The fastest of the measured runs (fastest first) and its margin over the next."""
    if not measured:
        return "no loader setting was measured"
    best = measured[0]
    rate = median(best.metrics or {}, "samples_per_s")
    text = f"fastest: {best.label} at {rate:,.0f} samples/s"
    if len(measured) > 1:
        second = measured[1]
        other = median(second.metrics or {}, "samples_per_s")
        text += f", {rate / other:.2f}x the next ({second.label}, {other:,.0f} samples/s)" if rate and other else ""
    return text


def skipped_files(per_repeat: Iterable[list[tuple[str, str]]]) -> list[SkippedFile]:
    """One entry per unreadable file (path, what was wrong, how many times a repeat met it): a file
    met in every epoch of every repeat is still one file."""
    files: dict[str, SkippedFile] = {}
    for skipped in per_repeat:
        for path, why in skipped:
            files.setdefault(path, SkippedFile(path=path, reason=why, times=0)).times += 1
    return list(files.values())


def timing_rows(plan: list[Setting]) -> dict[str, list]:
    """The columns of timings.parquet: one row per batch of every repeat of every setting."""
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
