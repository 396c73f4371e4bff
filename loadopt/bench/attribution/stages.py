"""Bottleneck attribution by stages run apart (as DS-Analyzer does), for the best setting of
each backend: `loadopt bench --tune` or `--attribute-stages` (a plain bench stays fast without them).

Stages, each a capacity in samples/s:
- compute alone: the accelerator's step on an in-memory batch (the bench's ceilings);
- storage read alone: the files this loader reads (the JPEGs, the Arrow file, the raw shards), page
  cache evicted first, read sequentially (a budget of bytes or seconds);
- decode + transform alone, from memory: the ceiling of what the setting does (the bench's ceilings:
  JPEG decode x cores, or the memory copy of decoded pixels);
- the loader warm (its files read into the page cache first) and the loader cold (evicted first, as
  the runner's cold runs do), each a short run of the harness.
The verdict names the stage that bounds the job (compute, the storage fetch, the preparation, or the
loader itself falling short of its stage), its capacity against the job's demand, and what would move it.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import psutil
import torch

from loadopt.bench.accelerator import Accelerator, make_accelerator
from loadopt.bench.attribution import verdicts as attribution
from loadopt.bench.harness import run_repeat
from loadopt.config_models import Config
from loadopt.device import DeviceTransfer
from loadopt.loaders.registry import backend_class, configured_loader
from loadopt.progress import Reporter
from loadopt.schema.ceilings import (
    Ceilings,
    ComputeStage,
    Job,
    LoaderRun,
    PrepStage,
    StageMeasurement,
    Stages,
    StorageStage,
    Verdict,
)
from loadopt.schema.documents import Knobs, ResultsFile
from loadopt.schema.metrics import RepeatMetrics
from loadopt.storage.dataset import Dataset
from loadopt.storage.tiers.pagecache import cold_note, evict, evict_for_cold

STORAGE_BUDGET_BYTES = 128 << 20
STORAGE_BUDGET_S = 2.0
STAGE_BATCHES = 20  # measured batches of each loader run (or workload.measure_batches when fewer)
LOADER_SHORT_OF_STAGE = 0.7  # below this fraction of its bounding stage, the loader itself is the limit


def _read_file(path: str, limit: int) -> int:
    """Read up to `limit` bytes of `path` sequentially; the bytes read. (Tests swap in a slow tier.)"""
    nbytes = 0
    with open(path, "rb", buffering=0) as handle:
        while nbytes < limit and (chunk := handle.read(min(4 << 20, limit - nbytes))):
            nbytes += len(chunk)
    return nbytes


def storage_alone(files: list[str], budget_bytes: int = STORAGE_BUDGET_BYTES,
                  budget_s: float = STORAGE_BUDGET_S) -> StorageStage:
    """Sequential read rate of the loader's own files with the page cache evicted first."""
    if not files:
        return StorageStage(skipped="the loader reads no local files (nothing to evict or read apart)")
    evicted = evict(files)
    start, nbytes, count = time.perf_counter(), 0, 0
    for path in files:
        nbytes += _read_file(path, budget_bytes - nbytes)
        count += 1
        if nbytes >= budget_bytes or time.perf_counter() - start > budget_s:
            break
    seconds = time.perf_counter() - start
    return StorageStage(name="storage read alone", bytes_per_s=nbytes / seconds if seconds > 0 else None,
                        bytes=nbytes, note=f"{count} of {len(files)} files read after {evicted} were evicted "
                                           "from the page cache")


def warm_files(files: list[str]) -> str:
    """Read the loader's files into the page cache when they fit in half the available memory."""
    total = sum(os.path.getsize(f) for f in files)
    if total > psutil.virtual_memory().available // 2:
        return f"not warmed: its {total / 1e9:,.1f} GB do not fit in half the available memory"
    for path in files:
        _read_file(path, total)
    return f"its {len(files)} files ({total / 1e6:,.0f} MB) read into the page cache first"


def _loader_run(config: Config, dataset: Dataset, device: torch.device, backend: str, settings: Knobs,
                cold: bool, accelerator: Accelerator) -> tuple[LoaderRun, list[str], RepeatMetrics]:
    """A short run of the loader warm or cold; the files it reads and its metrics beside."""
    loader = configured_loader(backend, config, dataset, backend_class(backend).Settings(**settings), device=device)
    try:
        loader.prepare(convert_missing=False)
        if loader.runs_apart:  # run in this process: a crash on bad bytes would end the bench
            loader.screen_samples()
        files = loader.storage_files()
        if cold:
            evicted, left = evict_for_cold(files)
            note = cold_note(evicted, len(files), left)
        else:
            note = warm_files(files)
        w = config.workload
        result = run_repeat(loader, accelerator, DeviceTransfer(device, emulate=True), min(w.warmup_batches, 2),
                            min(w.measure_batches, STAGE_BATCHES))
    finally:
        loader.close()
    m: dict[str, Any] = dict(result.metrics)
    per_sample = m["bytes_read"] / m["samples"] if m["samples"] and m["bytes_read"] else None
    batches = max(m["batches"], 1)
    run = LoaderRun(samples_per_s=m["samples_per_s"], stall_fraction=m["stall_fraction"], note=note,
                    loader_stall_fraction=m.get("loader_stall_fraction"),
                    finish_stall_fraction=m.get("finish_stall_fraction"), bytes_read_per_sample=per_sample,
                    wait_ms=m["wait_s"] / batches * 1000.0, finish_ms=m["finish_s"] / batches * 1000.0)
    return run, files, m


def measure_stages(config: Config, dataset: Dataset, device: torch.device, backend: str, settings: Knobs,
                   label: str, ceilings: Ceilings) -> StageMeasurement:
    """The stages of one loader setting measured apart, and the verdict on which bounds the job."""
    w = config.workload
    accelerator = make_accelerator(w.model, w.step_time_ms, len(dataset.classes), device)
    warm, files, run_metrics = _loader_run(config, dataset, device, backend, settings, False, accelerator)
    storage = storage_alone(files)
    cold, _, _ = _loader_run(config, dataset, device, backend, settings, True, accelerator)
    # Decode + transform from memory: the ceiling of what this setting does, as if the cache were warm (the
    # warm run's metrics: what a batch of this setting carries to the device, for the copy ceiling).
    prep = attribution.bounding_ceiling(run_metrics, label, ceilings,
                                        ceilings.job.model_copy(update={"cache": "warm"}), settings)
    per_sample = cold.bytes_read_per_sample or float(dataset.sizes.mean())
    storage_rate = storage.bytes_per_s / per_sample if storage.bytes_per_s else None
    stages = Stages(
        compute=ComputeStage(samples_per_s=ceilings.compute.samples_per_s),
        storage=storage.model_copy(update={"samples_per_s": storage_rate, "bytes_per_sample": per_sample}),
        prep=PrepStage(name=prep.name, kind=prep.stage, samples_per_s=prep.samples_per_s, words=prep.words,
                       lift=prep.lift),
        loader_warm=warm, loader_cold=cold)
    verdict = stage_verdict(stages, ceilings.job)
    return StageMeasurement(label=label, stages=stages, bottleneck=verdict.bottleneck, text=verdict.text)


class StageVerdict(NamedTuple):
    """Which stage bounds the job, and the sentence that says it."""

    bottleneck: str
    text: str
def stage_verdict(stages: Stages, job: Job) -> StageVerdict:
    """Which stage bounds the job, its capacity against the demand, and what would move it (one sentence)."""
    cold_job = job.cache == "cold"
    run = stages.loader_cold if cold_job else stages.loader_warm
    rate, stall = run.samples_per_s, run.stall_fraction
    demand = job.demand_samples_per_s
    need = f"the job needs {demand:,.0f} samples/s" if demand else "the job asks as fast as possible (step time 0)"
    both = (f"the loader delivers {stages.loader_warm.samples_per_s:,.0f} samples/s warm and "
            f"{stages.loader_cold.samples_per_s:,.0f} cold")
    storage, prep = stages.storage, stages.prep
    fetch = storage.samples_per_s
    fetch_words = (f"the storage reads {(storage.bytes_per_s or 0) / 1e6:,.0f} MB/s = {fetch:,.0f} samples/s of "
                   f"{(storage.bytes_per_sample or 0) / 1e3:,.0f} KB") if fetch else ""
    if stall < attribution.STALL_COMPUTE_BOUND:
        compute = stages.compute.samples_per_s
        cap = f"compute alone runs {compute:,.0f} samples/s" if compute else "compute alone"
        return StageVerdict("compute-bound",
                            f"compute-bound: {cap}, the accelerator is busy {1 - stall:.0%} of the time; {both}; "
                            "a faster accelerator step (or a larger model batch) would move it, a faster loader "
                            "would not")
    # The bounding stage: preparation always; the storage fetch when the job reads cold (the warm one hits
    # the page cache).
    stage, capacity, words, lift = prep.kind, prep.samples_per_s, prep.words, prep.lift
    if cold_job and fetch and (capacity is None or fetch < capacity):
        stage, capacity, words = "fetch-bound", fetch, fetch_words
        lift = "a faster tier, more reads in flight, a warm page cache or a smaller stored form would move it"
    emulated = job.device == "cpu"
    finishing = attribution.finishing_stalls(run.loader_stall_fraction, run.finish_stall_fraction, run.wait_ms,
                                             run.finish_ms)
    if finishing and emulated and stage == "prep-bound":
        # The loader decodes on the same cores the emulated device finishes on: neither bounds alone.
        return StageVerdict("cpu-bound",
                            f"cpu-bound: decoding ({words}) and finishing the batches on the device (emulated on the "
                            f"host CPU here: {run.finish_ms:.1f} ms a batch) share the same cores; {need}; {both}; "
                            f"on a GPU the finishing leaves the CPU to decoding; here {lift}")
    if finishing:  # batches arrive in time; finishing them is the stall
        where = " (emulated on the host CPU here)" if emulated else ""
        return StageVerdict("finish-bound",
                            f"finish-bound: batches arrive in time (wait {run.wait_ms:.1f} ms a batch) but copying "
                            f"and normalising them on the device{where} takes {run.finish_ms:.1f} ms a batch; "
                            f"{need}; {both}; uint8 batches (normalised in the model) and pinned, non-blocking "
                            "copies would move it")
    if capacity and rate < LOADER_SHORT_OF_STAGE * capacity:
        return StageVerdict("loader-bound",
                            f"loader-bound: {words}, yet {both} ({rate / capacity:.0%} of that capacity), "
                            f"{need}; more workers or threads, or deeper prefetch would move it")
    of = f" ({rate / capacity:.0%} of that capacity)" if capacity else ""
    if capacity and rate > attribution.CEILING_OVERSHOOT * capacity:  # measured low: no fraction as a fact
        of = " (above that capacity as measured: the stage's measurement is unreliable)"
    tail = f"; cold it would be fetch-bound ({fetch_words})" if not cold_job and fetch and fetch < (capacity or 0) \
        else ""
    return StageVerdict(stage, f"{stage}: {words}, {need}; {both}{of}; {lift}{tail}")


def attribute_stages(config: Config, dataset: Dataset, device: torch.device, results: ResultsFile,
                     ceilings: Ceilings, reporter: Reporter | None = None) -> None:
    """Stages apart for each backend's best setting; its verdict replaces the ceiling-only one (all of them
    at the end: a bench stopped on the way keeps its verdicts and gets no stages)."""
    by_label = {r.label: r for r in results.runs}
    verdicts = [v.model_copy() for v in results.verdicts if isinstance(v, Verdict)]  # the bench writes no sentence
    found = []
    for verdict in verdicts:
        run = by_label[verdict.label]
        if reporter is not None:
            reporter.run_started(f"stages apart: {verdict.label}", 0)
        stage = measure_stages(config, dataset, device, run.backend, run.settings or {}, run.label, ceilings)
        verdict.bottleneck, verdict.text, verdict.by = stage.bottleneck, stage.text, "stages measured apart"
        found.append(stage)
    if verdicts:
        results.verdicts = [*verdicts]
    results.stages = found
