"""Every backend through one tier of `loadopt tiers`: each configured backend (arrow and posix in both forms,
decoded and encoded, side by side; every other swept knob at its last listed value, `tier_plan.backend_sweep`)
runs through the harness as one accelerator on the tier, cold, every byte through the tier; the fastest is that
tier's decision, recorded as `loadopt bench` records it (keyed by the tier). `run_tiers` runs it per tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadopt.config_models import Config
from loadopt.procurement.plan import TierPlan, backend_sweep
from loadopt.procurement.tiers_document import BackendComparison, BackendRun, TierDecision
from loadopt.progress import TiersProgress
from loadopt.storage.tiers.spec import TierSpec

if TYPE_CHECKING:
    from loadopt.progress import Reporter

DECISION_KEYS = ("backend", "label", "samples_per_s", "runner_up", "margin", "text", "excluded", "bounded_by_base")
BACKEND_FIGURES = ("samples_per_s", "mb_per_s", "accelerator_utilisation", "bytes_read", "tier_bytes", "wall_s")


def compare_backends(config: Config, spec: TierSpec, out: str, warmup_batches: int, measure_batches: int,
                     reporter: Reporter | None = None, quick: bool = False,
                     bounded_by_base: str | None = None) -> BackendComparison:
    """Every backend of `backend_sweep` through tier `spec` (cold, one accelerator), as `loadopt bench`
    runs them: their figures, where their bytes came from, and the decision recorded for this tier
    (which says so when the tier's row is bounded by the storage under it: `bounded_by_base`).
    `interrupted_by` is set when Ctrl-C or SIGTERM stopped them (the runs that finished are kept)."""
    from loadopt.bench.runner import run_bench

    workload = config.workload.model_copy(update={"warmup_batches": warmup_batches,
                                                  "measure_batches": measure_batches, "repeats": 1})
    tier_config = config.model_copy(update={
        "loaders": backend_sweep(config, quick), "workload": workload,
        "storage": config.storage.model_copy(update={"tier": spec.model_dump(mode="json"), "cache": "cold"})})
    outcome = run_bench(tier_config, out=out, attribute=False, reporter=reporter)
    results = outcome.document()
    compared = BackendComparison(runs=[_backend_run(run) for run in results["runs"]], ranking=results["ranking"],
                                 results=str(outcome.json_path) if outcome.json_path else None,  # None: nothing
                                 decision=_tier_decision(results.get("decision"), bounded_by_base))
    if outcome.interrupted:
        compared.interrupted_by = results.get("interrupted_by") or "SIGINT"
    return compared


def _backend_run(run: Any) -> BackendRun:
    """One run of a bench's results (a results.json run, read as the dict it is) as the tier records it."""
    from loadopt.bench.metrics import median

    figures = {key: median(run["metrics"], key) for key in BACKEND_FIGURES} if "metrics" in run else {}
    return BackendRun(label=run["label"], backend=run["backend"], status=run["status"], reason=run["reason"],
                      form=(run.get("settings") or {}).get("form"), bytes_source=run.get("bytes_source"),
                      recipe=run.get("recipe"), bounded_by_base=run.get("bounded_by_base"), **figures)


def _tier_decision(made: Any, bounded_by_base: str | None) -> TierDecision | None:
    """The keys of a bench's decision (read as the dict it is) the tier keeps, saying where the tier's row is
    bounded by the storage under it; None where the bench decided nothing."""
    kept = {key: value for key, value in (made or {}).items() if key in DECISION_KEYS}
    if not kept:
        return None
    decision = TierDecision.model_validate(kept)
    if bounded_by_base and not decision.bounded_by_base:
        decision.bounded_by_base = bounded_by_base
        decision.text = f"{decision.text or ''}; the tier's row is {bounded_by_base}"
    return decision


def tier_backends(config: Config, spec: TierSpec, plan: TierPlan, out: str, quick: bool, say: TiersProgress,
                  bounded_by_base: str | None) -> BackendComparison:
    """Every backend through the tier (their benches under `out`), as its plan sizes them; none where the plan
    says why not."""
    if not plan.backend_settings:
        return BackendComparison(runs=[], ranking=[], results=None, decision=None,
                                 skipped=plan.backend_note or "no backend to compare")
    say.status(f"{spec.name}: every backend through the tier")
    say.line(f"{spec.name}: every backend through the tier, cold: {plan.backend_settings} settings, "
             f"{plan.backend_warmup} + {plan.backend_batches} batches each"
             f"{' (' + plan.backend_note + ')' if plan.backend_note else ''}")
    return compare_backends(config, spec, str(Path(out) / _folder_name(spec.name)), plan.backend_warmup,
                            plan.backend_batches, say.bench_reporter(), quick, bounded_by_base)


def _folder_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "tier"
