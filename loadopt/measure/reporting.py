"""What `loadopt.measure` reports: the metrics of `loadopt bench`, a verdict, results files, ranks.

The metrics are computed by `loadopt bench`'s function (loadopt.bench.metrics.step_metrics) and the file
is written through the one results schema (loadopt.schema.documents), so `loadopt report` and other readers take both.
Under `torchrun` every rank writes `measure-rank<r>.json` into a shared folder and rank 0 gathers them
by polling that folder with a timeout: no collective call that could hang a job whose other ranks died.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from loadopt.bench.metrics import aggregate, percentile_ms, step_metrics
from loadopt.errors import OutputError
from loadopt.files import atomic_write_text
from loadopt.machine import machine_fingerprint, machine_info
from loadopt.schema.documents import SCHEMA_VERSION, ResultsFile, Run, RunStatus, as_dict, results_text
from loadopt.schema.metrics import RepeatMetrics

COMMAND = "loadopt.measure"
CPU_NOTE = "on the CPU the loop body stands for the accelerator"


class MeasureResults(ResultsFile):
    """measure.json (and each rank's measure-rank<r>.json): a results file with what measure adds. Written
    with the keys set (`as_dict`), so a field left unset is no key in the file."""

    created_unix: float | None = None  # when it was written: a rank's file counts for this job's gather
    machine_fingerprint: str | None = None
    main: str | None = None  # the label of the longest-measured run (None: nothing measured)
    steps: int = 0  # the main run's steps
    rank: int | None = None  # a rank's own file: its rank, world size and how many times it has written
    world_size: int | None = None  # also in rank 0's gathered measure.json
    sequence: int | None = None
    missing_ranks: list[int] | None = None  # rank 0's gathered file: ranks that never reported, the slowest one
    slowest_rank: int | None = None


@dataclass
class Recorded:
    """What a measurement holds, in the units it was recorded in."""

    wait_ns: np.ndarray  # per step: asking for the batch -> holding it
    step_ns: np.ndarray  # per step: the loop body (handing the batch out -> asking for the next)
    samples: np.ndarray
    sample_bytes: float | None  # stored bytes per sample, when the caller said
    cpu_seconds: float | None
    storage_bytes_read: int
    peak_rss_bytes: int
    peak_pss_bytes: int
    h2d_bytes: int
    h2d_s: float
    h2d_pinned: bool
    device_busy_s: float | None  # from CUDA events; None on the CPU
    device_idle_s: float | None
    unmarked_waits: int  # measure_steps: steps whose batch was never marked (wait unknown)


def recorded_metrics(rec: Recorded) -> RepeatMetrics:
    """The flat metrics of one measurement, named as `loadopt bench` names them."""
    waits, steps = rec.wait_ns / 1e9, rec.step_ns / 1e9
    wall = float(waits.sum() + steps.sum())
    samples = int(rec.samples.sum())
    busy, idle = rec.device_busy_s, rec.device_idle_s
    utilisation: float | None = None  # None: compute_s / wall, as bench
    compute_s = float(steps.sum())
    on_device = False  # CUDA events timed the device: its busy share is the utilisation
    if busy is not None and idle is not None and busy + idle > 0:
        on_device, compute_s, utilisation = True, busy, busy / (busy + idle)
    metrics = step_metrics(
        waits_s=waits, wall_s=wall, compute_s=compute_s, samples=samples, batches=len(steps),
        # no mb_per_s when the stored bytes are unknown, or nothing was timed
        sample_bytes=samples * rec.sample_bytes if rec.sample_bytes and wall > 0 else None, h2d_s=rec.h2d_s,
        h2d_bytes=rec.h2d_bytes, cpu_seconds=rec.cpu_seconds, storage_bytes_read=rec.storage_bytes_read,
        peak_rss_bytes=rec.peak_rss_bytes or None, peak_pss_bytes=rec.peak_pss_bytes or None,
        utilisation=utilisation)
    metrics.update({
        "compute_source": "cuda events" if on_device else f"loop body ({CPU_NOTE})",
        "wait_fraction": float(waits.sum()) / wall if wall > 0 else 0.0,
        "step_p50_ms": percentile_ms(steps, 50),
        "step_p95_ms": percentile_ms(steps, 95),
        "h2d_pinned": rec.h2d_pinned,
        "unmarked_waits": rec.unmarked_waits,
    })
    if on_device:
        metrics["device_idle_fraction"] = metrics["stall_fraction"]
    return metrics


def _figure(metrics: RepeatMetrics, key: str) -> float:
    """A figure every measurement with a step has (`recorded_metrics`)."""
    value = metrics.get(key)
    if value is None or isinstance(value, str):
        raise KeyError(f"no {key!r} in the measured metrics")
    return value


def _speedup(stall: float) -> str:
    value = 1.0 / (1.0 - stall) if stall < 0.999 else float("inf")
    return f"{value:.1f}x" if value >= 1.5 else f"{value:.2f}x"


def verdict(metrics: RepeatMetrics, label: str | None = None) -> str:
    """One paragraph: how long the loop waited for data and what a faster loader would gain."""
    stall, on_device = _figure(metrics, "stall_fraction"), metrics["compute_source"] == "cuda events"
    name = f" {label}" if label else ""
    text = f"measure{name}: {metrics['batches']:,} steps, {metrics['samples_per_s']:,.0f} samples/s; "
    if on_device:
        text += (f"the device sat idle between steps {stall:.0%} of the time (CUDA events) and the loop waited "
                 f"for data {metrics['wait_fraction']:.0%} of the wall time")
    else:
        text += f"the loop waited for data {stall:.0%} of the wall time"
    text += f" (wait p50 {metrics['wait_p50_ms']:.1f} ms, p99 {metrics['wait_p99_ms']:.1f} ms); "
    if stall >= 0.05:
        # Up to 1/(1 - stall): a loader that never keeps the loop waiting removes the wait, no more.
        text += (f"{'input-bound' if stall >= 0.15 else 'partly input-bound'}: a faster loader (see `loadopt bench`)"
                 f" would speed this job up by up to {_speedup(stall)}.")
    else:
        text += (f"compute-bound: the step takes {1 - stall:.0%} of the time, so a faster loader would gain at most "
                 f"{_speedup(stall)}; the loader keeps up.")
    if not on_device:
        text += f" ({CPU_NOTE[0].upper()}{CPU_NOTE[1:]}.)"
    if metrics.get("unmarked_waits"):
        text += (f" {metrics['unmarked_waits']} steps had no `m.batch()` mark: their wait is unknown and was counted"
                 " as step time.")
    return text


_machine_info = functools.cache(machine_info)  # library versions and /proc reads: once per process


def run_entry(label: str, metrics: RepeatMetrics | None) -> Run:
    """One entry of `runs`, as `loadopt bench` writes it (one repeat)."""
    if metrics is None:
        return Run(backend="measured", label=label, settings=None, status=RunStatus.NOT_RUN,
                   reason="no batch was measured")
    return Run(backend="measured", label=label, settings=None, status=RunStatus.OK, reason="",
               metrics=aggregate([metrics]), repeats=[metrics])


def results_document(measured: list[tuple[str, RepeatMetrics | None]], device: str,
                     world_size: int | None = None) -> MeasureResults:
    """A results file with one run per measured iterable; `summary` is the verdict of the longest one."""
    machine = _machine_info()
    runs = [run_entry(label, metrics) for label, metrics in measured]
    done = [(label, m) for label, m in measured if m is not None]
    main = max(done, key=lambda item: _figure(item[1], "wall_s"), default=None)
    document = MeasureResults(
        schema_version=SCHEMA_VERSION, command=COMMAND,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), created_unix=time.time(),
        device=device, machine=machine, machine_fingerprint=machine_fingerprint(machine), runs=runs,
        ranking=[label for label, _ in sorted(done, key=lambda item: -_figure(item[1], "samples_per_s"))],
        main=main[0] if main else None, summary=verdict(main[1]) if main else "no batch was measured",
        steps=int(_figure(main[1], "batches")) if main else 0)
    if world_size is not None:
        document.world_size = world_size
    return document


def write_json(path: str | os.PathLike[str], document: MeasureResults) -> Path:
    """Write atomically; an unwritable place is the user's to fix (OutputError naming it)."""
    target = Path(path).expanduser()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, results_text(as_dict(document)))  # validated against loadopt.schema.documents
    except OSError as exc:
        raise OutputError(f"{target}: cannot write the measure results ({exc.strerror or exc})") from None
    return target


def rank_info() -> tuple[int, int]:
    """(rank, world size): torch.distributed when initialised, else torchrun's environment."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except (ImportError, RuntimeError):
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def write_ranked(folder: str | os.PathLike[str], document: MeasureResults, rank: int, world_size: int,
                 wait_s: float, sequence: int) -> Path:
    """Single process: `measure.json`. Several ranks: `measure-rank<r>.json`, and rank 0 also writes
    `measure.json` with every rank that reported within `wait_s` and the slowest one named."""
    folder = Path(folder).expanduser()
    if world_size <= 1:
        return write_json(folder / "measure.json", document)
    own = document.model_copy(update={"rank": rank, "world_size": world_size, "sequence": sequence})
    path = write_json(folder / f"measure-rank{rank}.json", own)
    if rank != 0:
        return path
    docs = _gather(folder, own, world_size, wait_s)
    return write_json(folder / "measure.json", rank_aggregate(docs, world_size, document.device or "cpu", wait_s))


def _gather(folder: Path, own: MeasureResults, world_size: int, wait_s: float) -> dict[int, MeasureResults]:
    # A file counts when it is from this job (written after this process started; ranks start
    # together) and from the same point of it (sequence: how many times that rank has written).
    since = psutil.Process().create_time() - 1.0
    docs = {0: own}
    deadline = time.monotonic() + wait_s
    while True:
        for rank in range(1, world_size):
            if rank in docs:
                continue
            try:  # a rank's file half-written or of another version: not (yet) reported
                doc = MeasureResults.model_validate(json.loads((folder / f"measure-rank{rank}.json").read_text()))
            except (OSError, ValueError):
                continue
            if (doc.created_unix or 0) >= since and (doc.sequence or 0) >= (own.sequence or 0):
                docs[rank] = doc
        if len(docs) == world_size or time.monotonic() >= deadline:
            return docs
        time.sleep(0.05)


def _main_metrics(doc: MeasureResults) -> RepeatMetrics | None:
    for run in doc.runs:
        if run.label == doc.main and run.repeats:
            return run.repeats[0]
    return None


def rank_aggregate(docs: dict[int, MeasureResults], world_size: int, device: str, wait_s: float) -> MeasureResults:
    """One run per rank ("rank <r>", its longest-measured iterable); the slowest rank is the one that
    waited longest for data: in data-parallel training the others wait for it in the all-reduce."""
    measured = [(f"rank {r}", _main_metrics(docs[r]) if r in docs else None) for r in range(world_size)]
    document = results_document(measured, device, world_size=world_size)
    missing = [r for r in range(world_size) if r not in docs]
    for run, rank in zip(document.runs, range(world_size), strict=True):
        if rank in missing:
            run.status, run.reason = RunStatus.MISSING, f"no results from this rank within {wait_s:g} s"
    present = [(r, m) for r, (_, m) in enumerate(measured) if m is not None]
    document.missing_ranks = missing
    if not present:
        document.slowest_rank = None
        return document
    slowest, metrics = max(present, key=lambda item: (_figure(item[1], "wait_s"), -_figure(item[1], "samples_per_s")))
    stalls = sorted(_figure(m, "stall_fraction") for _, m in present)
    document.slowest_rank = slowest
    document.summary = (f"{world_size} ranks ({len(present)} reported); slowest: rank {slowest}, which waited "
                        f"{metrics['wait_s']:.1f} s for data (median rank stall {stalls[len(stalls) // 2]:.0%}). "
                        + verdict(metrics, f"rank {slowest}"))
    document.steps = int(_figure(metrics, "batches"))
    return document
