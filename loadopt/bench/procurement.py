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
encoded form can win, on a fast one the decoded form.

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadopt.bench.consumers import ConsumerSettings, run_consumers
from loadopt.bench.tier_plan import (
    QUICK_PROBE_S,
    TierPlan,
    backend_sweep,
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
from loadopt.config_models import Config
from loadopt.errors import ConfigError, Terminated
from loadopt.progress import TiersProgress
from loadopt.schema import SCHEMA_VERSION
from loadopt.storage.probe import probe
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
    from loadopt.progress import Reporter

# ---------------------------------------------------------------------------------------------
# The procurement table


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


DECISION_KEYS = ("backend", "label", "samples_per_s", "runner_up", "margin", "text", "excluded", "bounded_by_base")


def compare_backends(config: Config, spec: TierSpec, out: str, warmup_batches: int, measure_batches: int,
                     reporter: Reporter | None = None, quick: bool = False,
                     bounded_by_base: str | None = None) -> dict[str, Any]:
    """Every backend of `backend_sweep` through tier `spec` (cold, one accelerator), as `loadopt bench`
    runs them: their figures, where their bytes came from, and the decision recorded for this tier
    (which says so when the tier's row is bounded by the storage under it: `bounded_by_base`).
    `interrupted_by` is set when Ctrl-C or SIGTERM stopped them (the runs that finished are kept)."""
    from loadopt.bench.metrics import median
    from loadopt.bench.runner import run_bench

    workload = config.workload.model_copy(update={"warmup_batches": warmup_batches,
                                                  "measure_batches": measure_batches, "repeats": 1})
    tier_config = config.model_copy(update={
        "loaders": backend_sweep(config, quick), "workload": workload,
        "storage": config.storage.model_copy(update={"tier": spec.model_dump(mode="json"), "cache": "cold"})})
    outcome = run_bench(tier_config, out=out, attribute=False, reporter=reporter)
    results = outcome.document()
    runs = []
    for run in results["runs"]:
        row = {"label": run["label"], "backend": run["backend"], "status": run["status"], "reason": run["reason"],
               "form": (run.get("settings") or {}).get("form"), "bytes_source": run.get("bytes_source"),
               "recipe": run.get("recipe"),  # a setting of another recipe never becomes the tier's decision
               "bounded_by_base": run.get("bounded_by_base")}
        if "metrics" in run:
            m = run["metrics"]
            row.update({key: median(m, key) for key in ("samples_per_s", "mb_per_s", "accelerator_utilisation",
                                                         "bytes_read", "tier_bytes", "wall_s")})
        runs.append(row)
    decision = {k: v for k, v in (results.get("decision") or {}).items() if k in DECISION_KEYS}
    if decision and bounded_by_base and not decision.get("bounded_by_base"):
        decision["bounded_by_base"] = bounded_by_base
        decision["text"] = f"{decision.get('text', '')}; the tier's row is {bounded_by_base}"
    compared: dict[str, Any] = {"runs": runs, "ranking": results["ranking"],
                                "results": str(outcome.json_path) if outcome.json_path else None,  # None: nothing
                                "decision": decision or None}
    if outcome.interrupted:
        compared["interrupted_by"] = results.get("interrupted_by") or "SIGINT"
    return compared


# ---------------------------------------------------------------------------------------------
# The procurement table


def run_tiers(config: Config, tiers: list[str | dict[str, Any]], *, au: float = 0.9, max_accelerators: int = 64,
              readers: int = 4, prefetch: int = 2, warmup_s: float = 1.0, measure_s: float = 3.0,
              probe_s: float = 1.0, budget_s: float = 300.0, capacity_tb: float | None = None,
              progress: TiersProgress | None = None, backends_out: str | None = None, backend_warmup: int = 3,
              backend_batches: int = 20, consumers: Callable[..., dict[str, Any]] = run_consumers,
              ranks: int | None = None, quick: bool = False) -> dict[str, Any]:
    """For each tier: supported accelerators (measured and predicted), with what was delivered and cost;
    with `backends_out` (a folder), also every backend compared on it (`compare_backends`). `consumers` plays
    a trial's accelerators (forked processes; under torchrun the job's `ranks`, bench/tier_ranks.py).
    `quick`: no sequential probe, the last `variant` only, and each tier's backend runs sized to its figures.
    Ctrl-C or SIGTERM ends it early with the tiers that finished (`interrupted_by`)."""
    if not 0 < au <= 1:
        raise ConfigError(f"--au {au}: expected a utilisation threshold in (0, 1]")
    if max_accelerators < 1:
        raise ConfigError(f"--max-accelerators {max_accelerators}: expected at least 1")
    say = progress or TiersProgress()
    started = time.perf_counter()
    specs = [resolve_tier(t, where=f"--tiers {t}") for t in tiers]
    settings = ConsumerSettings(config.pipeline.batch_size, config.workload.step_time_ms / 1000.0, readers, prefetch,
                                config.seed, config.pipeline.shuffle, config.pipeline.drop_last)
    rows: list[dict[str, Any]] = []
    need = None
    current: dict[str, Any] = {}
    interrupted_by: str | None = None
    plans: list[TierPlan] = []
    try:
        datasets = []
        for spec in specs:
            say.status(f"{spec.name}: opening the dataset")
            datasets.append(_open_for_tier(config, spec))
            plans.append(plan_tier(config, spec, datasets[-1], au=au, max_accelerators=max_accelerators,
                                   readers=readers, probe_s=probe_s, ranks=ranks, backends=backends_out is not None,
                                   backend_warmup=backend_warmup, backend_batches=backend_batches, quick=quick))
        say.line(plan_line(plans, warmup_s, measure_s, budget_s))
        for index, (spec, dataset, plan) in enumerate(zip(specs, datasets, plans, strict=True)):
            tier_started = time.perf_counter()
            current = {"tier": spec.name, "stage": "probe", "trials": []}
            need = demand(config, float(dataset.sizes.mean()), au)
            row = _measure_tier(config, spec, dataset, plan, need, settings, consumers, say, current, au=au,
                                warmup_s=warmup_s, measure_s=measure_s, probe_s=probe_s, budget_s=budget_s,
                                capacity_tb=capacity_tb, quick=quick, readers=readers)
            rows.append(row)
            searched_s = time.perf_counter() - tier_started
            backends_started = time.perf_counter()
            if backends_out is not None:
                current = {"tier": spec.name, "stage": "backends"}
                if plan.backend_settings:
                    say.status(f"{spec.name}: every backend through the tier")
                    say.line(f"{spec.name}: every backend through the tier, cold: {plan.backend_settings} settings, "
                             f"{plan.backend_warmup} + {plan.backend_batches} batches each"
                             f"{' (' + plan.backend_note + ')' if plan.backend_note else ''}")
                    row["backends"] = compare_backends(config, spec, str(Path(backends_out) / _folder_name(spec.name)),
                                                       plan.backend_warmup, plan.backend_batches,
                                                       say.bench_reporter(), quick, row.get("bounded_by_base"))
                else:
                    row["backends"] = {"runs": [], "ranking": [], "results": None, "decision": None,
                                       "skipped": plan.backend_note or "no backend to compare"}
            row["seconds"]["backends"] = time.perf_counter() - backends_started
            elapsed = time.perf_counter() - started
            left = sum(p.seconds(warmup_s, measure_s, budget_s) for p in plans[index + 1:])
            say.line(_tier_line(row, len(row["trials"]), searched_s, time.perf_counter() - tier_started) +
                     f" [{duration_text(elapsed)} in all{f', about {duration_text(left)} left' if left else ''}]")
            interrupted_by = (row.get("backends") or {}).get("interrupted_by")
            if interrupted_by:
                current = {}  # the tier's row is kept, with the backend runs that finished
                break
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where the caller made it one (errors.Terminated)
        interrupted_by = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    from loadopt.machine import machine_info

    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "command": "loadopt tiers",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config_source": config.source, "config": {"name": config.name}, "machine": machine_info(),
        "device": "emulated accelerators", "au_threshold": au, "quick": quick,
        "demand": need,
        "consumer": {"kind": "storage reader (the samples' stored bytes, no decode; as DLIO / MLPerf Storage)",
                     "readers": readers, "prefetch_batches": prefetch, "warmup_s": warmup_s,
                     "measure_s": measure_s, "max_accelerators": max_accelerators},
        "plan": {"tiers": [p.name for p in plans], "trials_expected": sum(len(p.expected_trials) for p in plans),
                 "trials_at_most": sum(len(p.longest_trials) for p in plans),
                 "expected_s": sum(p.seconds(warmup_s, measure_s, budget_s) for p in plans),
                 "at_most_s": sum(p.seconds(warmup_s, measure_s, budget_s, worst=True) for p in plans)},
        "elapsed_s": time.perf_counter() - started,
        "interrupted": interrupted_by is not None,
        "runs": [],  # no loader settings: the report shows the tiers section of this file
        "tiers": rows}
    if interrupted_by is not None:
        doc["interrupted_by"] = interrupted_by
        if current:  # the tier cut short: what it had measured, not a row (its search did not end)
            doc["cut_short"] = current
    return doc


def _measure_tier(config: Config, spec: TierSpec, dataset, plan: TierPlan, need: dict[str, float],
                  settings: ConsumerSettings, consumers: Callable[..., dict[str, Any]], say: TiersProgress,
                  current: dict[str, Any], *, au: float, warmup_s: float, measure_s: float, probe_s: float,
                  budget_s: float, capacity_tb: float | None, quick: bool, readers: int) -> dict[str, Any]:
    """One tier's row: its probe, its search, what bounded it, and its cost."""
    capacity = capacity_tb if capacity_tb is not None else float(dataset.sizes.sum()) / 1e12
    say.status(f"{spec.name}: probing")
    began = time.perf_counter()
    probed_on = _tier_dataset(dataset, spec)
    probed = dataset_probe(probed_on, QUICK_PROBE_S if quick else probe_s, plan.most * readers,
                           sequential=not quick)
    probed_s = time.perf_counter() - began
    probe_share = base_share(tier_counters(probed_on.fs))
    predicted = predict(probed, need["mb_per_s_at_threshold"], readers, plan.most)
    current["stage"] = "search"

    def trial(n: int) -> dict[str, Any]:
        say.status(f"{spec.name}: {n} accelerator{'s' if n != 1 else ''}")
        began = time.perf_counter()
        tiered = _tier_dataset(dataset, spec)
        result = consumers(tiered, settings, n, warmup_s, measure_s)
        result["base_share"] = base_share(tier_counters(tiered.fs))
        result["seconds"] = time.perf_counter() - began
        kept = result["passed"] = result["accelerator_utilisation"] >= au
        current["trials"].append({k: v for k, v in result.items() if k != "per_consumer"})
        say.line(f"{spec.name}: trial {len(current['trials'])} (at most {len(plan.longest_trials)}): {n} "
                 f"accelerator{'s' if n != 1 else ''}, AU {result['accelerator_utilisation']:.1%} "
                 f"{'>=' if kept else '<'} {au:.0%}, {result['mb_per_s']:,.1f} MB/s, CPU load "
                 f"{result['cpu_load']:.0%} ({result['seconds']:.1f} s)")
        return result

    searched = time.perf_counter()
    measured, trials, note = search(trial, au, plan.most, budget_s)
    seconds = {"probe": probed_s, "search": time.perf_counter() - searched, "backends": 0.0}
    if plan.bound is not None and measured == plan.most:
        note = f"at least {plan.most}: the search stops there, {plan.bound}"
    at = next((t for t in trials if t["accelerators"] == measured), None)
    # The trial that set the count: the smallest count above it that fell short.
    short = min((t for t in trials if not t["passed"] and t["accelerators"] > measured),
                key=lambda t: t["accelerators"], default=None)
    trial_share = short.get("base_share") if short is not None else None
    figures = profile_points(spec, float(dataset.sizes.mean()), probe_levels(plan.most * readers))
    by_figures = predict_from(figures, need["mb_per_s_at_threshold"], readers, plan.most) if figures else {}
    most_by_figures = by_figures.get("accelerators") or 0
    # Bounded by the base where its reads ran past the tier's figures and that lowered a count below theirs:
    # the measured one (through the trial that fell short) or the probe's prediction.
    bounded = None
    if (trial_share or 0) >= BASE_BOUND_SHARE and most_by_figures > measured or \
            (probe_share or 0) >= BASE_BOUND_SHARE and most_by_figures > (predicted.get("accelerators") or 0):
        delivered = [m for _, m in probe_points(probed)] + [t["mb_per_s"] for t in trials]
        bounded = base_bound_text(spec.name, storage_under(probed_on.fs, str(dataset.root)),
                                  max(delivered, default=None))
        by_figures.update({"source": "the tier's own figures (the storage under it is slower)",
                           "probe_accelerators": predicted.get("accelerators")})
        predicted = by_figures
        note = f"{note}; {bounded}"
    else:
        predicted["source"] = "the probe"
    cost = tier_costs(spec, capacity, measured)
    # one key each (loadopt.schema.TierRow, schema version 2): the keys `loadopt report` reads
    return {"name": spec.name, "spec": spec.redacted(), "accelerators_supported": measured,
            "measured_note": note, "au_threshold": au, "predicted_accelerators": predicted["accelerators"],
            "au_by_accelerators": sorted([t["accelerators"], t["accelerator_utilisation"]] for t in trials
                                         if t.get("accelerator_utilisation") is not None),
            "price_per_tb_month": spec.price_per_tb_month,
            "cost_per_supported_accelerator": cost["per_accelerator_month"],
            "prediction": predicted,
            "delivered_mb_s": at["mb_per_s"] if at else 0.0,
            "samples_per_s": at["samples_per_s"] if at else 0.0,
            "accelerator_utilisation": at["accelerator_utilisation"] if at else None,
            "cpu_load": at["cpu_load"] if at else None,
            "cost": {"per_month": cost["per_month"]}, "capacity_tb": capacity,
            "bounded_by_base": bounded, "seconds": seconds,
            "base": {"storage": storage_under(probed_on.fs, str(dataset.root)), "probe_share": probe_share,
                     "deciding_trial_share": trial_share, "bound_share": BASE_BOUND_SHARE},
            "trials": [{k: v for k, v in t.items() if k != "per_consumer"} for t in trials],
            "probe": probed}


def _tier_line(row: dict[str, Any], trials: int, searched_s: float, tier_s: float) -> str:
    """One tier's outcome, as the progress says it."""
    count = row["accelerators_supported"]
    text = (f"{row['name']}: {count} accelerator{'s' if count != 1 else ''} kept at AU >= {row['au_threshold']:.0%} "
            f"({row['measured_note']}), predicted {row['predicted_accelerators']} from "
            f"{row['prediction'].get('source', 'the probe')}; {trials} trials, {searched_s:.0f} s")
    backends = row.get("backends")
    if backends is not None:
        decision = backends.get("decision") or {}
        text += (f"; backends: {backends['skipped']}" if backends.get("skipped") else
                 f"; backends {tier_s - searched_s:.0f} s, auto picks {decision.get('label') or 'nothing'}")
    return text


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "tier"


def dataset_probe(dataset, duration_s: float, most_in_flight: int = 64, sequential: bool = True) -> dict[str, Any]:
    """The probe of a tier for prediction: whole-sample reads at 1, 4, 16 and 64 in flight (those up to
    `most_in_flight`, and that one: no more are ever in flight in the search), and sequential reads."""
    if dataset.kind == "records":  # <root>/<record file>
        root = os.path.dirname(dataset.files[0].decode())
    else:  # <root>/<class>/<sample>, as the tier's fs names it
        root = os.path.dirname(os.path.dirname(dataset.path(0)))
    return probe(root, fs=dataset.fs, block_sizes=(), concurrencies=probe_levels(most_in_flight), duration_s=duration_s,
                 seq_bytes=64 << 20, whole_files=True, cold=False, max_requests=200_000, sequential=sequential)
