"""A bench's results in the experiment trackers teams already read (`loadopt bench --log-to`): TensorBoard, Weights &
Biases and MLflow, each an optional extra. Each gets the same three things from the files the bench wrote: the
table (one scalar per setting and metric, and the Markdown table as text), the ceilings measured in the run, and
the per-batch timeline (each setting's wait and step times by batch).

A tracker is named as `kind` or `kind:where` (`tensorboard:runs/loadopt`, `wandb:my-project`,
`mlflow:file:./mlruns`); `check_target` refuses an unknown kind or a missing package in one line before any work.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadopt.errors import ConfigError

# The metrics of each setting's row that a tracker gets, as results.json names them.
TABLE_METRICS = ("samples_per_s", "mb_per_s", "accelerator_utilisation", "stall_fraction", "wait_p50_ms",
                 "wait_p99_ms", "cpu_seconds_per_1k_samples", "peak_pss_mb", "h2d_gb_per_s")
# Per batch, from timings.parquet, in milliseconds.
TIMELINE_COLUMNS = ("wait_s", "compute_s", "h2d_s", "finish_s")


@dataclass
class TrackedRun:
    """What a tracker records of one bench: its name, scalars per setting, the ceilings, the table as text and the
    measured batches' timeline per setting (step -> {column: ms})."""

    name: str
    created: str
    scalars: dict[str, dict[str, float]] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)
    table: str = ""
    timeline: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    results_path: Path | None = None


def tracked_run(results_path: Path) -> TrackedRun:
    """The run to record, read from a bench's `results.json` and the `timings.parquet` beside it."""
    from loadopt.report import render_report

    document = json.loads(results_path.read_text())
    run = TrackedRun(name=f"loadopt-{(document.get('config') or {}).get('name') or results_path.parent.name}",
                     created=document.get("created") or "", results_path=results_path)
    for row in document.get("runs", []):
        metrics = row.get("metrics") or {}
        values = {key: median for key in TABLE_METRICS if (median := _median(metrics.get(key))) is not None}
        if isinstance(row.get("fraction_of_ceiling"), int | float):
            values["fraction_of_ceiling"] = float(row["fraction_of_ceiling"])
        if values:
            run.scalars[row["label"]] = values
    for name, ceiling in (document.get("ceilings") or {}).items():
        rate = ceiling.get("samples_per_s") if isinstance(ceiling, dict) else None
        rate = rate if rate is not None else (ceiling.get("gb_per_s") if isinstance(ceiling, dict) else None)
        if isinstance(rate, int | float):
            run.ceilings[name] = float(rate)
    run.table = render_report([results_path], "markdown")
    timings = results_path.parent / "timings.parquet"
    if timings.is_file():
        import pyarrow.parquet as pq

        table = pq.read_table(timings).to_pylist()
        for row in table:
            if row.get("measured"):
                run.timeline.setdefault(row["label"], []).append(
                    {column.removesuffix("_s") + "_ms": 1e3 * float(row[column]) for column in TIMELINE_COLUMNS
                     if row.get(column) is not None})
    return run


def _median(metric: object) -> float | None:
    """A metric of results.json (its median over repeats, `{"median": ...}`, or a plain number) as a float."""
    value = metric.get("median") if isinstance(metric, dict) else metric
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _tensorboard(run: TrackedRun, where: str) -> str:
    from torch.utils.tensorboard import SummaryWriter

    folder = Path(where or "runs") / f"{run.name}-{run.created.replace(':', '')}"
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for label, values in run.scalars.items():
            for metric, value in values.items():
                writer.add_scalar(f"table/{metric}/{label}", value, 0)
        for name, rate in run.ceilings.items():
            writer.add_scalar(f"ceilings/{name}", rate, 0)
        for label, batches in run.timeline.items():
            for step, times in enumerate(batches):
                for column, value in times.items():
                    writer.add_scalar(f"timeline/{label}/{column}", value, step)
        writer.add_text("table", run.table, 0)
    finally:
        writer.close()
    return str(folder)


def _wandb(run: TrackedRun, where: str) -> str:
    import wandb

    session = wandb.init(project=where or "loadopt", name=run.name, reinit=True)
    try:
        columns: list[str | int] = ["setting", *TABLE_METRICS]
        session.log({"table": wandb.Table(columns=columns, data=[[label, *(values.get(m) for m in TABLE_METRICS)]
                                                               for label, values in run.scalars.items()]),
                     **{f"ceilings/{name}": rate for name, rate in run.ceilings.items()}})
        for label, batches in run.timeline.items():
            for step, times in enumerate(batches):
                session.log({f"timeline/{label}/{column}": value for column, value in times.items()} |
                            {f"timeline/{label}/batch": step})
        if run.results_path is not None:
            session.save(str(run.results_path), base_path=str(run.results_path.parent), policy="now")
        url = getattr(session, "url", None) or session.dir
    finally:
        session.finish()
    return str(url)


def _mlflow(run: TrackedRun, where: str) -> str:
    import mlflow

    if where:
        mlflow.set_tracking_uri(where)
    with mlflow.start_run(run_name=run.name) as active:
        for label, values in run.scalars.items():
            mlflow.log_metrics({_mlflow_key(f"{metric}/{label}"): value for metric, value in values.items()})
        mlflow.log_metrics({_mlflow_key(f"ceilings/{name}"): rate for name, rate in run.ceilings.items()})
        for label, batches in run.timeline.items():
            for step, times in enumerate(batches):
                mlflow.log_metrics({_mlflow_key(f"timeline/{label}/{column}"): value
                                    for column, value in times.items()}, step=step)
        mlflow.log_text(run.table, "results.md")
        if run.results_path is not None:
            mlflow.log_artifact(str(run.results_path))
        return f"{mlflow.get_tracking_uri()} run {active.info.run_id}"


def _mlflow_key(key: str) -> str:
    """MLflow's metric names allow letters, digits and `_-. /` only: a setting's `=` becomes `-`."""
    return "".join(c if c.isalnum() or c in "_-. /" else "-" for c in key)


# kind -> (how it records, the module it needs, the extra that installs it)
TRACKERS: dict[str, tuple[Callable[[TrackedRun, str], str], str, str]] = {
    "tensorboard": (_tensorboard, "tensorboard", "tensorboard"),
    "wandb": (_wandb, "wandb", "wandb"),
    "mlflow": (_mlflow, "mlflow", "mlflow"),
}


def check_target(target: str) -> tuple[str, str]:
    """(kind, where) of `--log-to TARGET`, or one line naming what is wrong: an unknown kind, a package missing."""
    kind, _, where = target.partition(":")
    if kind not in TRACKERS:
        raise ConfigError(f"--log-to {target}: unknown tracker {kind!r} (known: {', '.join(TRACKERS)}; e.g. "
                          "tensorboard:runs/loadopt)")
    _, module, extra = TRACKERS[kind]
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--log-to {target}: {module} is not installed (pip install 'loadopt[{extra}]')") from None
    return kind, where


def log_results(results_path: Path, target: str) -> str:
    """Record the bench whose `results.json` is `results_path` in the tracker `target`; returns where it went."""
    kind, where = check_target(target)
    return TRACKERS[kind][0](tracked_run(results_path), where)
