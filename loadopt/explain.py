"""`loadopt explain`: what `make_loader(backend="auto")` will do here and why, or what a results file says.

- For a config: the recorded decision that applies to this dataset on this machine (backend, setting,
  its measured rate, when), or why none applies (also: its setting delivers another training input than
  the config asks for, `loadopt.recipe`) and what `auto` falls back to; the faster settings of other
  recipes that the decision left out, with the difference.
- For a results file (from `loadopt bench` or `loadopt.measure`): its closing verdict, then one
  sentence per measured setting on where its time went.
"""

from __future__ import annotations

from pathlib import Path

from loadopt.report.data import Run
from loadopt.report.data import load as load_results


def explain_config(config, relist: bool = False) -> str:
    """The decision `auto` would use for `config` on this machine, in sentences (`relist`: the dataset
    listed again, its saved listing replaced)."""
    from loadopt.api import FALLBACK_ORDER
    from loadopt.bench import decision
    from loadopt.storage.open import open_dataset

    dataset = open_dataset(config, relist=relist)
    tier = decision.storage_tier(config.storage.tier, dataset.root)
    lines = [f"dataset {dataset.root} (fingerprint {dataset.fingerprint}), {len(dataset):,} samples, "
             f"storage tier {tier}"]
    found, match, why = decision.find(config.pipeline.model_dump(mode="json"), dataset.fingerprint, tier)
    differs = _recipe_differences(found, config, dataset) if found is not None else []
    if differs and found is not None:  # auto never moves a job onto another training input
        why = (f"the recorded decision {found['label']} delivers another training input than this config "
               f"({'; '.join(differs)}): auto does not use it")
        found = None
    if found is not None:
        margin = f", {found['margin']:.2f}x the runner-up {found['runner_up']['label']}" if found.get("margin") else \
            " (no other backend was measured)"
        tuned = " after tuning (loadopt bench --tune)" if found.get("tuned") else ""
        lines.append(f"auto uses: {found['label']} ({found.get('samples_per_s', 0):,.0f} samples/s{margin}), "
                     f"the fastest in the bench{tuned} of {found.get('created', '?')} on this machine, loadopt "
                     f"{found.get('loadopt_version') or '?'} ({decision.decision_path(dataset.fingerprint)})")
        if match == "other settings":
            lines.append(f"note: {why}; rerun `loadopt bench` to decide for these")
        for excluded in found.get("excluded") or []:
            lines.append(f"not considered: {excluded['label']}: another training input "
                         f"({'; '.join(excluded['differences'])})")
        return "\n".join(lines)
    lines.append(why)
    from loadopt.api import make_loader

    loader = make_loader(config)  # what auto does with no decision: the first ready in the fixed order
    lines.append(f"auto falls back to: {loader.name} {loader.describe()} (the first available of "
                 f"{', '.join(FALLBACK_ORDER)} that can read this dataset as it is; auto starts no conversion); "
                 "run `loadopt bench` to decide by measurement")
    loader.close()
    return "\n".join(lines)


def _recipe_differences(found: dict, config, dataset) -> list[str]:
    """How the decision's setting, built for this config (never prepared), differs from the config's recipe."""
    from loadopt import recipe
    from loadopt.errors import LoadoptError
    from loadopt.loaders.registry import backend_class
    try:
        cls = backend_class(found["backend"])
        loader = cls(dataset, config.pipeline, cls.Settings(**(found.get("settings") or {})), seed=config.seed)
    except (LoadoptError, KeyError, ValueError, TypeError):  # an unknown backend or setting: auto tells then
        return []
    return recipe.differences(loader.recipe(), recipe.wanted(config.pipeline, kind=dataset.kind))


def _run_sentence(run: Run) -> str:
    from loadopt.bench.metrics import median
    from loadopt.schema.metrics import took_no_step

    if run.status != "ok" or not run.metrics:
        return f"{run.label}: {run.status}: {run.reason}"
    m = run.metrics
    rate, stall = median(m, "samples_per_s") or 0.0, median(m, "stall_fraction") or 0.0
    p99, wall, wait = median(m, "wait_p99_ms"), median(m, "wall_s"), median(m, "wait_s")
    tail = f", wait p99 {p99:,.1f} ms" if p99 is not None else ""
    if took_no_step(m):
        return f"{run.label}: {rate:,.0f} samples/s, batches taken as fast as they came (no step){tail}"
    text = f"{run.label}: {rate:,.0f} samples/s, the accelerator idle {stall:.0%} of the time"
    if stall < 0.05:
        return text + ": compute-bound, the input path keeps up"
    waiting = wait / wall if wall and wait is not None else None
    if waiting is not None and waiting < stall / 2:
        # The loader kept up; the idle time went to the copy to the device and finishing there.
        return text + (f": the loader kept up (waiting for data {waiting:.0%}{tail}); the rest went to the copy to "
                       "the device and normalising there")
    return text + f": input-bound, waiting for data{tail}"


def explain_results(path: str | Path) -> str:
    """The verdict of a bench or measure results file (or the folder that holds one), and a sentence per setting."""
    # the one reader of results files (its errors name the file in one line); the verdicts need no timings
    results = load_results(path, timings=False)
    doc = results.doc
    lines = [f"{doc.get('command', 'loadopt')} results from {doc.get('created', '?')} "
             f"on {doc.get('device', '?')}: {doc.get('summary', '')}"]
    lines += [f"- {_run_sentence(run)}" for run in results.runs]
    return "\n".join(lines)
