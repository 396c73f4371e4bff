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
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loadopt.bench.consumers import ConsumerSettings, run_consumers
from loadopt.config_models import Config
from loadopt.errors import ConfigError
from loadopt.schema import SCHEMA_VERSION
from loadopt.storage.probe import probe
from loadopt.storage.tiers import TierSpec, resolve_tier, tier_filesystem

Progress = Callable[[str], None]


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


# ---------------------------------------------------------------------------------------------
# One consumer (runs in a forked process)




def search(trial: Callable[[int], dict[str, Any]], threshold: float, max_n: int,
           budget_s: float) -> tuple[int, list[dict[str, Any]], str]:
    """The largest N in [0, max_n] whose trial keeps mean AU >= threshold: doubling, then bisection.
    Returns (N, the trials, a note on what bounded the search)."""
    started = time.perf_counter()
    trials: list[dict[str, Any]] = []
    passed, failed = 0, None

    def run(n: int) -> bool:
        result = trial(n)
        result["passed"] = result["accelerator_utilisation"] >= threshold
        trials.append(result)
        return result["passed"]

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


def predict(probe_result: dict[str, Any], need_mb_s: float, readers: int, max_n: int) -> dict[str, Any]:
    """N_pred from the probe's whole-sample reads: the largest N whose share of what the tier delivers
    at N x readers requests in flight is at least `need_mb_s` (the per-accelerator demand at the AU
    threshold)."""
    points = sorted((p["concurrency"], p["mb_per_s"]) for p in probe_result["patterns"]
                    if p["pattern"] == "files" and "skipped" not in p)
    if not points:
        return {"accelerators": None, "note": "the probe measured no whole-sample reads"}
    supported = 0
    for n in range(1, max_n + 1):
        if _interpolate(points, n * readers) / n >= need_mb_s:
            supported = n
        else:
            break
    deliverable = _interpolate(points, max(supported, 1) * readers)
    return {"accelerators": supported, "deliverable_mb_s": deliverable,
            "probe_points": [{"concurrency": c, "mb_per_s": m} for c, m in points],
            "note": f"at most {max_n} (--max-accelerators)" if supported >= max_n else ""}


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


DECISION_KEYS = ("backend", "label", "samples_per_s", "runner_up", "margin", "text", "excluded")


def backend_sweep(config: Config) -> dict[str, dict[str, Any]]:
    """The backends to compare on each tier: the config's, arrow and posix in both forms (images; records
    and tokens have one stored form, whatever `form` says), every other swept knob at its last (most
    parallel) listed value."""
    loaders: dict[str, dict[str, Any]] = {}
    one_form = config.dataset.kind != "images"
    for name, raw in config.loaders.items():
        settings = {k: (v[-1] if isinstance(v, list) and v and (one_form or k not in ("form", "variant")) else v)
                    for k, v in raw.items()}
        if name in ("arrow", "posix", "kvikio") and not one_form:
            settings["form"] = ["decoded", "encoded"]
        loaders[name] = settings
    return loaders


def compare_backends(config: Config, spec: TierSpec, out: str, warmup_batches: int,
                     measure_batches: int) -> dict[str, Any]:
    """Every backend of `backend_sweep` through tier `spec` (cold, one accelerator), as `loadopt bench`
    runs them: their figures, where their bytes came from, and the decision recorded for this tier."""
    from loadopt.bench.metrics import median
    from loadopt.bench.runner import run_bench

    workload = config.workload.model_copy(update={"warmup_batches": warmup_batches,
                                                  "measure_batches": measure_batches, "repeats": 1})
    tier_config = config.model_copy(update={
        "loaders": backend_sweep(config), "workload": workload,
        "storage": config.storage.model_copy(update={"tier": spec.model_dump(mode="json"), "cache": "cold"})})
    outcome = run_bench(tier_config, out=out, attribute=False)
    results = outcome.results
    runs = []
    for run in results["runs"]:
        row = {"label": run["label"], "backend": run["backend"], "status": run["status"], "reason": run["reason"],
               "form": (run.get("settings") or {}).get("form"), "bytes_source": run.get("bytes_source"),
               "recipe": run.get("recipe")}  # a setting of another recipe never becomes the tier's decision
        if "metrics" in run:
            m = run["metrics"]
            row.update({key: median(m, key) for key in ("samples_per_s", "mb_per_s", "accelerator_utilisation",
                                                         "bytes_read", "tier_bytes", "wall_s")})
        runs.append(row)
    decision = results.get("decision") or {}
    return {"runs": runs, "ranking": results["ranking"],
            "results": str(outcome.json_path) if outcome.json_path else None,  # None: nothing measured
            "decision": {k: decision[k] for k in DECISION_KEYS if k in decision} or None}


def run_tiers(config: Config, tiers: list[str | dict[str, Any]], *, au: float = 0.9, max_accelerators: int = 64,
              readers: int = 4, prefetch: int = 2, warmup_s: float = 1.0, measure_s: float = 3.0,
              probe_s: float = 1.0, budget_s: float = 300.0, capacity_tb: float | None = None,
              progress: Progress | None = None, backends_out: str | None = None, backend_warmup: int = 3,
              backend_batches: int = 20, consumers: Callable[..., dict[str, Any]] = run_consumers,
              ranks: int | None = None) -> dict[str, Any]:
    """For each tier: supported accelerators (measured and predicted), with what was delivered and cost;
    with `backends_out` (a folder), also every backend compared on it (`compare_backends`). `consumers` plays
    a trial's accelerators (forked processes; under torchrun the job's `ranks`, bench/tier_ranks.py)."""
    if not 0 < au <= 1:
        raise ConfigError(f"--au {au}: expected a utilisation threshold in (0, 1]")
    if max_accelerators < 1:
        raise ConfigError(f"--max-accelerators {max_accelerators}: expected at least 1")
    say = progress or (lambda text: None)
    specs = [resolve_tier(t, where=f"--tiers {t}") for t in tiers]
    settings = ConsumerSettings(config.pipeline.batch_size, config.workload.step_time_ms / 1000.0, readers, prefetch,
                                config.seed, config.pipeline.shuffle, config.pipeline.drop_last)
    rows = []
    need = None
    for spec in specs:
        dataset = _open_for_tier(config, spec)
        need = demand(config, float(dataset.sizes.mean()), au)
        capacity = capacity_tb if capacity_tb is not None else float(dataset.sizes.sum()) / 1e12
        say(f"{spec.name}: probing")
        probed = dataset_probe(_tier_dataset(dataset, spec), probe_s, max_accelerators * readers)
        predicted = predict(probed, need["mb_per_s_at_threshold"], readers, max_accelerators)

        def trial(n: int, spec: TierSpec = spec, dataset=dataset) -> dict[str, Any]:
            say(f"{spec.name}: {n} accelerators")
            return consumers(_tier_dataset(dataset, spec), settings, n, warmup_s, measure_s)

        most, bound = max_accelerators, None
        by_data = max(1, len(dataset) // config.pipeline.batch_size)  # each accelerator reads its own shard
        if by_data < most:
            most, bound = by_data, (f"bounded by the dataset: {len(dataset):,} samples give at most {by_data} "
                                    f"accelerators a batch of {config.pipeline.batch_size} each (a larger dataset "
                                    "lifts it)")
        if ranks is not None and ranks < most:
            most, bound = ranks, f"bounded by the torchrun job: {ranks} ranks, one accelerator each"
        measured, trials, note = search(trial, au, most, budget_s)
        if bound is not None and measured == most:
            note = f"at least {most}: the search stops there, {bound}"
        at = next((t for t in trials if t["accelerators"] == measured), None)
        cost = tier_costs(spec, capacity, measured)
        # one key each (loadopt.schema.TierRow, schema version 2): the keys `loadopt report` reads
        rows.append({"name": spec.name, "spec": spec.redacted(), "accelerators_supported": measured,
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
                     "trials": [{k: v for k, v in t.items() if k != "per_consumer"} for t in trials],
                     "probe": probed})
        if backends_out is not None:
            say(f"{spec.name}: every backend through the tier")
            rows[-1]["backends"] = compare_backends(config, spec, str(Path(backends_out) / _folder_name(spec.name)),
                                                    backend_warmup, backend_batches)
    from loadopt.machine import machine_info

    return {"schema_version": SCHEMA_VERSION, "command": "loadopt tiers",
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "config_source": config.source, "config": {"name": config.name}, "machine": machine_info(),
            "device": "emulated accelerators", "au_threshold": au,
            "demand": need,
            "consumer": {"kind": "storage reader (the samples' stored bytes, no decode; as DLIO / MLPerf Storage)",
                         "readers": readers, "prefetch_batches": prefetch, "warmup_s": warmup_s,
                         "measure_s": measure_s, "max_accelerators": max_accelerators},
            "runs": [],  # no loader settings: the report shows the tiers section of this file
            "tiers": rows}


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "tier"


def dataset_probe(dataset, duration_s: float, most_in_flight: int = 64) -> dict[str, Any]:
    """The probe of a tier for prediction: sequential reads and whole-sample reads at 1, 4, 16 and 64 in
    flight (those up to `most_in_flight`, and that one: no more are ever in flight in the search)."""
    levels = sorted({c for c in (1, 4, 16, 64) if c < most_in_flight} | {min(64, most_in_flight)})
    if dataset.kind == "records":  # <root>/<record file>
        root = os.path.dirname(dataset.files[0].decode())
    else:  # <root>/<class>/<sample>, as the tier's fs names it
        root = os.path.dirname(os.path.dirname(dataset.path(0)))
    return probe(root, fs=dataset.fs, block_sizes=(), concurrencies=tuple(levels), duration_s=duration_s,
                 seq_bytes=64 << 20, whole_files=True, cold=False, max_requests=200_000)

