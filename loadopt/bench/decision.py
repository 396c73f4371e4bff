"""The decision a bench leaves behind for `make_loader(backend="auto")` and `loadopt explain`.

`decision.json` is written beside `results.json` and kept in `<cache>/decisions/<dataset fingerprint>.json`,
which holds one entry per (pipeline settings, machine) so that benches on several machines sharing a
cache folder (an NFS home) or with several pipelines do not overwrite each other. An entry has the
winning backend and settings, its margin over the runner-up, the date and the loadopt version, and is
keyed by the dataset fingerprint, the pipeline settings and the machine: CPU model and count, GPU
model, and the storage tier the dataset is read from.

Only settings whose recipe (`loadopt.recipe`: crop plan, sizes, normalisation, stored resolution) is the
config's can win: a faster path that changes the training input is no answer. The others are listed
in the decision (`excluded`) with the difference named.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from loadopt import recipe
from loadopt.bench.metrics import median
from loadopt.errors import OutputError
from loadopt.files import atomic_write_text, cache_dir, is_no_space
from loadopt.machine import MachineInfo, library_versions, machine_fingerprint, machine_info
from loadopt.schema.documents import (
    SCHEMA_VERSION,
    ConfigDump,
    Decision,
    Excluded,
    MachineKey,
    ResultsFile,
    Run,
    RunnerUp,
    RunStatus,
    SchemaError,
    as_dict,
    decision_text,
    parse_decision,
)

log = logging.getLogger(__name__)

FILE_NAME = "decision.json"


def decision_path(dataset_fingerprint: str) -> Path:
    return cache_dir() / "decisions" / f"{dataset_fingerprint}.json"


def storage_tier(tier: str | dict[str, Any], root: str) -> str:
    """The tier the dataset is read from: the config's tier (its name: never an inline tier's options,
    which may hold credentials) and, for local data, the filesystem type of the folder it sits in
    (`local:ext4`, `local:nfs4`, `local:tmpfs`); a URL's scheme otherwise."""
    from loadopt.storage.tiers.spec import tier_label

    if not isinstance(tier, str):  # a name already is safe (and may be a label of an inline tier)
        tier = tier_label(tier)
    if "://" in root and not root.startswith("file://"):
        return f"{tier}:{root.split('://', 1)[0]}"
    path = os.path.realpath(root.removeprefix("file://"))
    best, fstype = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    except OSError:
        pass
    return f"{tier}:{fstype}"


def machine_key(machine: MachineInfo, tier: str) -> MachineKey:
    """The machine a decision is made on (`machine`: loadopt.machine.machine_info()) and its storage tier."""
    gpu = machine.get("gpu")
    return MachineKey(fingerprint=machine_fingerprint(machine), cpu_model=machine["cpu_model"],
                      cpu_count=machine["cpu_count"], gpu=gpu["name"] if gpu else None, storage_tier=tier)


def pipeline_hash(pipeline: ConfigDump) -> str:
    return hashlib.sha256(json.dumps(pipeline, sort_keys=True).encode()).hexdigest()[:16]


def recipe_exclusions(results: ResultsFile) -> dict[str, list[str]]:
    """{label: differences} of the measured settings whose recipe is not the config's (`results.recipe`)."""
    out = {}
    for run in results.runs:
        differences = recipe.differences(run.recipe, results.recipe)
        if differences and run.metrics is not None:
            out[run.label] = differences
    return out


ORDER_OPT_IN = "not the sampler's order a DataLoader keeps; pipeline.order: any allows them"


def order_passed_over(results: ResultsFile, excluded: dict[str, list[str]]) -> list[str]:
    """The excluded settings whose library orders the samples itself (peers, dali reader native), by label:
    a drop-in for DataLoader keeps the sampler's order, so `auto` takes them only under `pipeline.order: any`."""
    by_label = {r.label: r for r in results.runs}
    recipes = {label: by_label[label].recipe for label in excluded}
    return [label for label, made in recipes.items() if made is not None and made.get("order") not in (None, "shared")]


def make_decision(results: ResultsFile, tier: str) -> Decision | None:
    """The decision of a finished bench: the fastest setting whose recipe is the config's, its margin
    over the runner-up backend (also of that recipe); the faster settings of other recipes are listed."""
    excluded = recipe_exclusions(results)
    # a run that delivered nothing (no rate) is no answer, whatever its status says
    ranked = [run for run in results.measured() if run.label not in excluded
              and run.status == RunStatus.OK and median(run.metrics or {}, "samples_per_s")]
    if not ranked:
        return None
    best = ranked[0]
    rate = median(best.metrics or {}, "samples_per_s")
    # The runner-up is the best setting of another backend: the margin says what switching would cost.
    other = next((r for r in ranked[1:] if r.backend != best.backend), None)
    other_rate = median(other.metrics or {}, "samples_per_s") if other else None
    margin = rate / other_rate if rate and other_rate else None
    machine = machine_key(results.machine or {}, tier)
    pipeline = (results.config or {})["pipeline"]
    if not isinstance(pipeline, dict):  # the key of the decision: the pipeline section as the config dumped it
        raise SchemaError(f"results config.pipeline: expected the pipeline section, got {pipeline!r}")
    created = results.created or ""
    return Decision(
        schema_version=SCHEMA_VERSION,
        backend=best.backend, settings=best.settings, label=best.label, samples_per_s=rate,
        runner_up=RunnerUp(label=other.label, backend=other.backend, samples_per_s=other_rate) if other else None,
        margin=margin, text=_decision_text(results, best, rate, other, margin, excluded),
        tuned=results.tuning is not None, recipe=best.recipe or results.recipe,
        # faster or not, never chosen: they deliver another training input
        excluded=[Excluded(label=label, differences=why) for label, why in excluded.items()],
        passed_over_for_order=order_passed_over(results, excluded),
        bounded_by_base=best.bounded_by_base,
        created=created, date=created[:10],
        loadopt_version=library_versions().get("loadopt"), config_source=results.config_source,
        device=results.device,
        # the key: dataset fingerprint, pipeline settings, machine (CPU, GPU, storage tier)
        dataset_fingerprint=results.dataset.fingerprint if results.dataset else None, pipeline=pipeline,
        pipeline_hash=pipeline_hash(pipeline), machine=machine, machine_fingerprint=machine.fingerprint,
    )


def _decision_text(results: ResultsFile, best: Run, rate: float | None, other: Run | None, margin: float | None,
                   excluded: dict[str, list[str]]) -> str:
    """The decision in one sentence: the setting, its margin, what was passed over and why."""
    text = f"{best.label} at {rate:,.0f} samples/s"
    text += f", {margin:.2f}x the runner-up {other.label}" if margin and other else " (no other backend measured)"
    own_order = order_passed_over(results, excluded)
    if own_order:
        text += f"; passed over for their library's own order ({ORDER_OPT_IN}): {', '.join(own_order)}"
    if best.bounded_by_base:  # its figures are the storage's under the emulated tier, not the tier's
        text += f"; {best.bounded_by_base}"
    return text


def partial(made: Decision, results: ResultsFile) -> Decision:
    """The decision of a bench that stopped (interrupted, or at an error) before every setting ran: the
    fastest of what it measured, marked `partial` with the settings it never compared. It is written beside
    the results (so the folder agrees with itself) but never into the cache: `auto` takes only a finished
    bench's answer."""
    unmeasured = [r.label for r in results.runs if r.status != RunStatus.OK or r.metrics is None]
    measured = len(results.runs) - len(unmeasured)
    stopped = f"interrupted by {results.interrupted_by}" if results.interrupted else "stopped at an error"
    return made.model_copy(update={
        "partial": True, "not_compared": unmeasured,
        "text": f"partial ({stopped}; {measured} of {len(results.runs)} settings measured, not used by "
                f"backend='auto'): {made.text}"})


def _entries(path: Path) -> list[Decision]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    # a list of entries, or one decision (written before entries)
    raw = doc["entries"] if isinstance(doc, dict) and isinstance(doc.get("entries"), list) else [doc]
    entries = []
    for entry in raw:  # through the schema; an entry of an unknown version or shape is not this loadopt's to use
        try:
            entries.append(parse_decision(entry, path))
        except SchemaError as exc:
            log.debug("%s", exc)
    return entries


def _same_machine(entry: Decision, here: MachineKey) -> bool:
    tier = entry.machine.storage_tier if entry.machine else None
    return entry.machine_fingerprint == here.fingerprint and tier in (None, here.storage_tier)


def record(decision: Decision, folder: Path | None) -> None:
    """Write a decision beside the results (`folder/decision.json`: its failure, a full disk, raises `OutputError`
    once the cache's entry is written) and into the cache's entries."""
    text = decision_text(decision)
    beside_failed: OutputError | None = None
    if folder is not None:
        try:
            atomic_write_text(folder / FILE_NAME, text)
        except (OSError, OutputError) as exc:
            beside_failed = _not_written(folder, exc)
    path = decision_path(decision.dataset_fingerprint or "")
    here = decision.machine or MachineKey()
    keep = [e for e in _entries(path) if not (_same_machine(e, here) and e.pipeline == decision.pipeline)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = [as_dict(decision), *(as_dict(e) for e in keep)]
        atomic_write_text(path, json.dumps({"schema_version": SCHEMA_VERSION, "entries": entries}, indent=2) + "\n")
    except (OSError, OutputError) as exc:  # the results are written; a missing decision only costs `auto` its memory
        log.warning("could not record the decision in %s: %s", path, exc)
    if beside_failed is not None:
        raise beside_failed


def _not_written(folder: Path, exc: OSError | OutputError) -> OutputError:
    """The one line of a decision.json that could not be written beside the results (atomic_write's OutputError is
    its full disk)."""
    why = "no space left on device" if isinstance(exc, OutputError) or is_no_space(exc) else (exc.strerror or str(exc))
    return OutputError(f"{folder / FILE_NAME}: cannot write the decision ({why}); the results beside it are this "
                       "bench's, with no decision file (results.json holds the decision)")


def record_beside(decision: Decision | None, folder: Path) -> None:
    """The decision of the results just written into `folder`, recorded (`record`); where the bench decided
    nothing (nothing of the config's recipe measured), the decision.json an earlier bench left there is
    removed: it would contradict the results beside it. A partial decision (`partial`) is written beside
    the results only. A decision.json that cannot be written beside them raises `OutputError`."""
    if decision is not None and decision.partial:
        try:
            atomic_write_text(folder / FILE_NAME, decision_text(decision))
        except (OSError, OutputError) as exc:
            raise _not_written(folder, exc) from None
        return
    if decision is not None:
        record(decision, folder)
        return
    try:
        (folder / FILE_NAME).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove the earlier bench's %s: %s", folder / FILE_NAME, exc)


def find(pipeline: ConfigDump, dataset_fingerprint: str, tier: str) -> tuple[dict[str, Any] | None, str, str]:
    """(decision, match, why) for this dataset, pipeline and machine. `match` is `exact`, `other settings`
    (this machine, other pipeline settings: used, with a warning), `other machine` (not used) or `none`.
    The decision is the entry as its file holds it (`as_dict`), for `auto` and `explain`."""
    found, match, why = find_entry(pipeline, dataset_fingerprint, tier)
    return (as_dict(found) if found is not None else None), match, why


def find_entry(pipeline: ConfigDump, dataset_fingerprint: str, tier: str) -> tuple[Decision | None, str, str]:
    """`find`, the decision as the schema's model."""
    path = decision_path(dataset_fingerprint)
    entries = _entries(path)
    here = machine_key(machine_info(), tier)
    # a partial decision (a stopped bench's) is never recorded here; one that got in by hand is not used either
    mine = [e for e in entries if _same_machine(e, here) and not e.partial]
    for entry in mine:
        if entry.pipeline == pipeline:
            return entry, "exact", f"the decision of the bench of {entry.created or '?'} on this machine ({path})"
    if mine:
        return mine[0], "other settings", (f"the decision in {path} was measured on this machine with other pipeline "
                                           f"settings ({_differences(mine[0].pipeline or {}, pipeline)})")
    if entries:
        return None, "other machine", (f"no bench decision for this machine: the one in {path} was made on another "
                                       f"machine ({_machine_differences(entries[0], here)}), auto does not use it")
    return None, "none", f"no bench decision for this dataset ({path} does not exist)" if not path.exists() \
        else f"no bench decision for this dataset in {path}"


def _differences(theirs: ConfigDump, mine: ConfigDump) -> str:
    """The first three pipeline settings (config dumps) that differ, there and here."""
    keys = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
    return ", ".join(f"{k} {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in keys[:3]) or "?"


def _machine_differences(entry: Decision, here: MachineKey) -> str:
    theirs = entry.machine
    recorded = theirs.model_fields_set if theirs is not None else set()
    keys = sorted(k for k in ("cpu_model", "cpu_count", "gpu", "storage_tier")
                  if k in recorded and getattr(theirs, k) != getattr(here, k))
    return ", ".join(f"{k} {getattr(theirs, k)!r} there, {getattr(here, k)!r} here" for k in keys[:3]) or \
        "its machine fingerprint differs"
