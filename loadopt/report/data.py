"""Reading results files for the report: `results.json` of `loadopt bench` (and later `tiers`), and
`measure.json` of `loadopt.measure`, with the per-batch `timings.parquet` beside them when present.

Every key beyond `runs` is optional here: a section whose data a file lacks says so instead of
guessing. Optional keys read (written by later issues; the shapes are the contract):

- `run["ceiling"] = {"name": "decode rate x cores", "samples_per_s": 2350.0}`: the ceiling that
  bounds that loader setting, measured on the same machine; the ranking shows the fraction. With
  `"unreliable": true` and a `"reason"` the run beat it by more than 10%: no fraction is shown.
- `machine.load = {"busy": bool, "note": "<sentence>", "others_cpu_share": ..., "load_average_1m": ...}`:
  the machine's load during the bench; the note is shown when it was busy.
- `"decision"`: `{"label": "<loader setting>", "text": "<sentence>"}` or a plain sentence.
- `"verdicts"`: a list of sentences, or of `{"label": ..., "bottleneck": "storage-bound", "text": ...}`.
- `"tiers"`: a list of `{"name", "au_threshold" (0-1), "accelerators_supported",
  "au_by_accelerators": [[n, au], ...], "price_per_tb_month", "cost_per_supported_accelerator",
  "predicted_accelerators"}` (all but `name` optional).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadopt.errors import LoadoptError
from loadopt.schema.ceilings import RunCeiling
from loadopt.schema.documents import ResultsFile, SchemaError, as_dict, parse_results
from loadopt.schema.metrics import IDLE_FIGURES, RepeatMetrics, RunMetrics, took_no_step

OVERSHOOT = 1.1  # a run above this fraction of its ceiling shows the ceiling was measured low


class ResultsFileError(LoadoptError):
    """A results file that is missing, unreadable or not a loadopt results file."""


@dataclass
class Run:
    """One loader setting (or one measured loop) of a results file."""

    label: str
    backend: str
    status: str
    reason: str
    metrics: RunMetrics
    repeats: list[RepeatMetrics]
    ceiling: RunCeiling | None  # the verdicts', as recorded

    @property
    def measured(self) -> bool:
        return self.status == "ok" and self.value("samples_per_s") is not None

    def why_unmeasured(self) -> str:
        """`status: reason` of a setting that has no throughput."""
        if self.status == "ok":
            return "not measured: the results hold no samples/s for it"
        return f"{self.status}: {self.reason or 'no reason given'}"

    def value(self, key: str) -> float | None:
        """The median of a metric over the repeats (None when the file lacks it, or an idle share of a run that
        had no step)."""
        if key in IDLE_FIGURES and took_no_step(self.metrics):
            return None
        raw = self.metrics.get(key)
        if isinstance(raw, dict):
            raw = raw.get("median")
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or math.isnan(raw):
            return None
        return float(raw)

    def spread(self, key: str) -> tuple[float, float] | None:
        raw = self.metrics.get(key)
        if isinstance(raw, dict) and isinstance(raw.get("min"), (int, float)) and isinstance(raw.get("max"),
                                                                                             (int, float)):
            return float(raw["min"]), float(raw["max"])
        return None

    def ceiling_rate(self) -> float | None:
        rate = self.ceiling.samples_per_s if self.ceiling is not None else None
        return float(rate) if rate is not None and rate > 0 else None

    def ceiling_unreliable(self) -> bool:
        """A ceiling the run beat by more than 10% (marked so by the bench, or found so here in an older
        file): it was measured low, and no fraction of it is shown as a fact."""
        ceiling, rate = self.ceiling_rate(), self.value("samples_per_s")
        return bool(self.ceiling is not None and self.ceiling.unreliable) or bool(
            ceiling and rate is not None and rate > OVERSHOOT * ceiling)

    def ceiling_fraction(self) -> float | None:
        """The fraction of its ceiling reached; None when unmeasured or unreliable."""
        ceiling, rate = self.ceiling_rate(), self.value("samples_per_s")
        if not ceiling or rate is None or self.ceiling_unreliable():
            return None
        return rate / ceiling

    def ceiling_cell(self) -> str:
        """The "of ceiling" cell: the fraction, `unreliable (reason)`, or "-"."""
        fraction = self.ceiling_fraction()
        if fraction is not None:
            return f"{fraction:.0%} of {self.ceiling.name if self.ceiling is not None else 'ceiling'}"
        if self.ceiling_unreliable():
            reason = (self.ceiling.reason if self.ceiling is not None else None) or \
                "the run beat its ceiling by more than 10%"
            return f"unreliable ({reason})"
        return "-"

    def per_step_ms(self) -> dict[str, float] | None:
        """Where a step's time goes, in ms (means over measured batches): the summed metrics / batches.

        `finish_s` (the copy and on-device finishing) includes `h2d_s`; only its remainder is shown as
        finishing. What is left of the wall time per batch (the harness, Python) is `other`.

        Where the harness split the accelerator's idle time (the emulated device, whose copy and finishing
        overlap the step before), a step is its compute and the idle time before it: `wait` the loader's
        share, `finish` the host finishing's (the copy included), so that the parts add up to the wall time."""
        batches = self.value("batches")
        if not batches:
            return None
        loader_stall, finish_stall = self.value("loader_stall_fraction"), self.value("finish_stall_fraction")
        wall, compute = self.value("wall_s"), self.value("compute_s")
        if loader_stall is not None and finish_stall is not None and wall and compute is not None:
            per_batch = wall / batches * 1000.0
            step = {"compute": compute / batches * 1000.0, "wait": loader_stall * per_batch,
                    "h2d": 0.0, "finish": finish_stall * per_batch}
            step["other"] = max(0.0, per_batch - sum(step.values()))
            return step
        parts = {"compute": self.value("compute_s"), "wait": self.value("wait_s"), "h2d": self.value("h2d_s")}
        if parts["compute"] is None or parts["wait"] is None:
            return None
        step = {k: (v or 0.0) / batches * 1000.0 for k, v in parts.items()}
        finish = self.value("finish_s")
        step["finish"] = max(0.0, (finish or 0.0) / batches * 1000.0 - step["h2d"]) if finish is not None else 0.0
        wall = self.value("wall_s")
        step["other"] = max(0.0, wall / batches * 1000.0 - sum(step.values())) if wall else 0.0
        return step


@dataclass
class Timings:
    """Per-batch timings of one run (all its repeats), as numpy columns."""

    repeat: np.ndarray
    batch: np.ndarray
    measured: np.ndarray
    start_s: np.ndarray
    wait_s: np.ndarray
    samples: np.ndarray


@dataclass
class Results:
    path: Path
    doc: dict[str, Any]  # the file as plain data (`as_dict(file)`), for the sections read as recorded
    file: ResultsFile
    runs: list[Run]
    tag: str = "A"
    timings: dict[str, Timings] = field(default_factory=dict)
    timings_note: str = ""  # why there are no per-batch timings, when there are none

    @property
    def ranked(self) -> list[Run]:
        """The measured runs, fastest first."""
        return sorted((r for r in self.runs if r.measured), key=lambda r: -(r.value("samples_per_s") or 0.0))

    @property
    def unmeasured(self) -> list[Run]:
        return [r for r in self.runs if not r.measured]

    @property
    def title(self) -> str:
        name = (self.doc.get("config") or {}).get("name") or self.doc.get("main") or self.path.parent.name
        device = self.doc.get("device") or "?"
        return f"{self.doc.get('command') or 'loadopt'}: {name} on {device}"

    @property
    def short_name(self) -> str:
        """`<folder>/<file>`: names the file without machine-dependent absolute paths."""
        return f"{self.path.parent.name}/{self.path.name}" if self.path.parent.name else self.path.name

    def bytes_sources(self) -> str | None:
        """Where the runs' bytes came from (results.json `runs[i].bytes_source`): the local disk read
        directly, or a storage tier every read passed through; None for files without it."""
        sources = sorted({str(r["bytes_source"]) for r in self.doc.get("runs") or []
                          if isinstance(r, dict) and r.get("bytes_source")})
        return "; ".join(sources) or None

    def busy_note(self) -> str | None:
        """The sentence saying the machine was busy during the bench (results.json `machine.load.note`)."""
        note = ((self.doc.get("machine") or {}).get("load") or {}).get("note")
        return note if isinstance(note, str) and note else None

    def machine_line(self) -> str:
        m = self.doc.get("machine") or {}
        gpu = m.get("gpu") or {}
        parts = [m.get("hostname"), m.get("cpu_model"),
                 f"{m['cpu_count']} cores" if m.get("cpu_count") else None,
                 f"{m['ram_gb']:g} GB RAM" if isinstance(m.get("ram_gb"), (int, float)) else None,
                 f"{gpu.get('count', 1)}x {gpu['name']}" if gpu.get("name") else "no GPU" if m else None]
        return ", ".join(str(p) for p in parts if p) or "machine not recorded"

    def workload_line(self) -> str:
        w = self.doc.get("workload") or {}
        parts = []
        if self.doc.get("quick"):
            parts.append("quick")
        if w:
            repeats = w.get("repeats", "?")
            parts.append(f"{repeats} repeat{'' if repeats == 1 else 's'} x {w.get('measure_batches', '?')} batches "
                         f"after {w.get('warmup_batches', '?')} warm-up")
            if w.get("model") and w["model"] != "none":
                parts.append(f"model {w['model']}")
            elif w.get("step_time_ms") == 0:
                parts.append("no step: batches taken as fast as they come")
            elif w.get("step_time_ms") is not None:
                parts.append(f"emulated step {w['step_time_ms']:g} ms")
        if self.doc.get("steps"):
            parts.append(f"{self.doc['steps']:,} steps measured in place")
        if (self.doc.get("cache") or {}).get("mode"):
            parts.append(f"{self.doc['cache']['mode']} cache")
        return "; ".join(parts)

    def decision(self) -> str:
        """The decision in one sentence: the file's own when it has one, else its summary."""
        decision = self.doc.get("decision")
        if isinstance(decision, dict) and decision.get("text"):
            return str(decision["text"])
        if isinstance(decision, str) and decision:
            return decision
        return str(self.doc.get("summary") or "no loader setting was measured")

    def verdicts(self) -> list[tuple[str | None, str]]:
        """(loader setting or None, sentence) per bottleneck verdict."""
        out: list[tuple[str | None, str]] = []
        for item in self.file.verdicts:
            if isinstance(item, str):
                out.append((None, item))
            elif item.text:
                out.append((item.label or None, item.text))
        return out

    def tiers(self) -> list[dict[str, Any]]:
        return [t for t in self.doc.get("tiers") or [] if isinstance(t, dict) and t.get("name")]

    def rate_unit(self) -> tuple[str, str]:
        """(metric key, unit) of the headline rate: tokens/s for token workloads, else samples/s."""
        ranked = self.ranked
        if ranked and all(r.value("tokens_per_s") is not None for r in ranked):
            return "tokens_per_s", "tokens/s"
        return "samples_per_s", "samples/s"


def resolve(path: str | os.PathLike[str]) -> Path:
    """A results file, or a folder holding `results.json` (or `measure.json`)."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name in ("results.json", "measure.json"):
            if (p / name).is_file():
                return p / name
        raise ResultsFileError(f"{p}: no results.json or measure.json in this folder")
    return p


def load(path: str | os.PathLike[str], tag: str = "A", timings: bool = True) -> Results:
    """Read one results file (and, with `timings`, its timings.parquet); user errors name the file in one line."""
    p = resolve(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ResultsFileError(f"{p}: no such results file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsFileError(f"{p}: cannot read the results file ({getattr(exc, 'strerror', None) or exc})") from None
    except ValueError as exc:
        raise ResultsFileError(f"{p}: not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ResultsFileError(f"{p}: not a loadopt results file (no 'runs' list)")
    for i, raw in enumerate(doc["runs"]):
        if not isinstance(raw, dict) or not isinstance(raw.get("label"), str):
            raise ResultsFileError(f"{p}: runs[{i}] is not a loader setting with a label")
    try:  # the schema's shape and version (loadopt.schema.documents); version 1 files are upgraded as read
        file = parse_results(doc, p)
    except SchemaError as exc:
        raise ResultsFileError(str(exc)) from None
    runs = []
    for raw, run in zip(doc["runs"], file.runs, strict=True):
        found = raw.get("metrics")
        metrics: RunMetrics = found if isinstance(found, dict) else {}
        runs.append(Run(raw["label"], str(raw.get("backend") or ""), str(raw.get("status") or "ok"),
                        str(raw.get("reason") or ""), metrics,
                        [r for r in raw.get("repeats") or [] if isinstance(r, dict)], run.ceiling))
    results = Results(p, as_dict(file), file, runs, tag)
    if timings:
        results.timings, results.timings_note = _timings(p.parent / "timings.parquet", runs)
    return results


def _timings(path: Path, runs: list[Run]) -> tuple[dict[str, Timings], str]:
    if not path.is_file():
        return {}, f"no per-batch timings ({path.name} is not beside the results file)"
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["label", "repeat", "batch", "measured", "start_s", "wait_s", "samples"])
    except Exception as exc:  # noqa: BLE001 - a damaged timings file costs two sections, not the report
        return {}, f"the per-batch timings could not be read ({path.name}: {str(exc).splitlines()[0]})"
    cols = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
    out: dict[str, Timings] = {}
    for run in runs:
        mask = cols["label"] == run.label
        if mask.any():
            out[run.label] = Timings(*(cols[k][mask] for k in ("repeat", "batch", "measured", "start_s", "wait_s",
                                                                "samples")))
    return out, "" if out else f"{path.name} holds no batch of these runs"


def load_all(paths: Sequence[str | os.PathLike[str]]) -> list[Results]:
    if not paths:
        raise ResultsFileError("no results file given")
    return [load(p, tag=chr(ord("A") + i) if i < 26 else str(i + 1)) for i, p in enumerate(paths)]


def common_labels(files: list[Results]) -> list[str]:
    """Labels measured in every file, in the first file's ranking order."""
    measured = [{r.label for r in f.ranked} for f in files]
    return [r.label for r in files[0].ranked if all(r.label in m for m in measured[1:])]


def median_repeat(run: Run) -> int:
    """The index of the repeat whose samples/s is the median one: the most representative timeline."""
    rates = [(r.get("samples_per_s") or 0.0, i) for i, r in enumerate(run.repeats)]
    if not rates:
        return 0
    rates.sort()
    return rates[(len(rates) - 1) // 2][1]


def stored_size(terabytes: float | None) -> str:
    """A dataset's stored size (the cost's capacity) in the unit that reads best: `1.2 TB`, `480 GB`, `3.1 MB`."""
    if not isinstance(terabytes, (int, float)):
        return "-"
    for unit, scale in (("TB", 1.0), ("GB", 1e-3), ("MB", 1e-6)):
        if terabytes >= scale:
            return f"{terabytes / scale:,.3g} {unit}"
    return f"{terabytes * 1e9:,.3g} KB"
