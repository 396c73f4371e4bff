"""The results of the commands as the terminal shows them: `loadopt bench`'s ranked table and the lines
under it (settings that did not run and why, where each run's bytes came from, each row's training
recipe); `loadopt probe`'s patterns; `loadopt tiers`' tiers and backends through each tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:  # the CLI's help stays light: the types only
    from loadopt.procurement.tiers_document import TiersRun
    from loadopt.recipe import Recipe
    from loadopt.schema.documents import ResultsFile, Run
    from loadopt.schema.metrics import RunMetrics
    from loadopt.storage.tiers.probe import ProbeResult



def _fmt(metrics: RunMetrics, key: str, spec: str, scale: float = 1.0) -> str:
    """A figure of the table ("-" where not measured, or an idle share of a run that had no step)."""
    from loadopt.bench.metrics import median
    from loadopt.schema.metrics import IDLE_FIGURES, took_no_step

    value = None if key in IDLE_FIGURES and took_no_step(metrics) else median(metrics, key)
    return "-" if value is None else format(value * scale, spec)


def results_table(results: ResultsFile) -> Table:
    """One row per loader setting, ranked by throughput, settings that did not run at the end: one line each
    within 120 columns (short setting labels, `labels.short_labels`; the full labels, spreads and settings
    are in results.json and the report)."""
    from loadopt.bench.metrics import median
    from loadopt.cli.labels import short_labels

    dataset = results.dataset
    samples = f"{dataset.num_samples} samples" + (f", {dataset.format}" if dataset.format else "") if dataset else "?"
    table = Table(title=f"loadopt bench: {(results.config or {})['name']} on {results.device}"
                        f" ({samples})", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    short = short_labels(results.runs)
    ranked = results.measured()
    tokens = any("tokens_per_s" in (run.metrics or {}) for run in ranked)
    volume = ("tokens/s", "tokens_per_s", ",.0f") if tokens else ("MB/s", "mb_per_s", ",.1f")
    sources = {_bytes_from(run) for run in ranked}
    columns = ["#", "setting", "samples/s", volume[0], "stall", "loader", "finish", "p99 ms", "CPU s/1k", "mem MB",
               "of ceil", "recipe"] + (["bytes from"] if len(sources) > 1 else [])  # one source: said under it
    for column in columns:
        table.add_column(column, justify="left" if column in ("setting", "recipe", "bytes from") else "right",
                         no_wrap=True)
    for rank, run in enumerate(ranked, start=1):
        m = run.metrics or {}
        fraction = run.fraction_of_ceiling
        # The fraction of the ceiling that bounds this setting, named in the verdicts.
        of_ceiling = f"{fraction:.0%}" if isinstance(fraction, (int, float)) else "-"
        if run.ceiling is not None and run.ceiling.unreliable:  # > 110%: the ceiling was measured low (said below)
            of_ceiling = "[yellow]?[/]"
        shown = short[run.label]
        if run.tuned:  # --tune: each backend's best setting, and how many were tried; a backend far behind
            climbed = not run.tuned.note.startswith("not climbed")  # after the first round keeps its start
            shown += f" (tried {run.tuned.tried} of {run.tuned.space_size}{'' if climbed else ', start only'})"
        loader, finish = _stall_parts(m)
        cells = [str(rank), escape(shown), f"{median(m, 'samples_per_s'):,.0f}", _fmt(m, volume[1], volume[2]),
                 _fmt(m, "stall_fraction", ".1%"), loader, finish, _fmt(m, "wait_p99_ms", ",.1f"),
                 _fmt(m, "cpu_seconds_per_1k_samples", ".2f"), _fmt(m, "peak_pss_mb", ",.0f"), of_ceiling,
                 _recipe_cell(run, results.recipe)]
        table.add_row(*cells, *([escape(_bytes_from(run)[:12])] if len(sources) > 1 else []))
    for run in results.runs:
        if run.label not in results.ranking:  # its reason goes under the table (not_run_lines)
            table.add_row("-", escape(short[run.label]), f"[yellow]{run.status}[/]", *[""] * (len(columns) - 3))
    return table


def verdict_lines(results: ResultsFile) -> list[str]:
    """One line per backend's best setting: what bounds it and by how much (the verdict's whole sentence is in
    results.json, the report and `loadopt explain`; the busy-machine note is said once, by the caller)."""
    from loadopt.bench.metrics import median
    from loadopt.cli.labels import short_labels
    from loadopt.schema.metrics import took_no_step

    short = short_labels(results.runs)
    by_label = {r.label: r for r in results.runs}
    need = results.ceilings.job.demand_samples_per_s if results.ceilings is not None else None
    lines = []
    for verdict in results.verdicts:
        if isinstance(verdict, str):  # a sentence of an older file: no setting to line up
            continue
        run = by_label.get(verdict.label)
        metrics = (run.metrics if run else None) or {}
        ceiling = run.ceiling if run else None
        rate, stall = median(metrics, "samples_per_s"), median(metrics, "stall_fraction")
        if took_no_step(metrics):
            stall = None
        parts = [f"{rate:,.0f} samples/s" if rate is not None else "no rate"]
        fraction = run.fraction_of_ceiling if run else None
        if fraction is not None and ceiling is not None and ceiling.name:
            parts.append(f"{fraction:.0%} of {ceiling.name} ({ceiling.samples_per_s or 0:,.0f}/s)")
        if need:
            parts.append(f"the job needs {need:,.0f}/s")
        if stall is not None:
            parts.append(f"stall {stall:.0%}")
        lines.append(f"{short.get(verdict.label, verdict.label)}: {verdict.bottleneck}: {', '.join(parts)}")
    return lines


def _stall_parts(metrics: RunMetrics) -> tuple[str, str]:
    """Whose the accelerator's idle share was: the loader's (batches late) and the host finishing's (batches
    there, their copy and finishing not done), where the harness split it (not on CUDA: `-`)."""
    from loadopt.bench.metrics import median
    from loadopt.schema.metrics import took_no_step

    loader, finish = median(metrics, "loader_stall_fraction"), median(metrics, "finish_stall_fraction")
    if loader is None or finish is None or took_no_step(metrics):
        return "-", "-"
    return f"{loader:.1%}", f"{finish:.1%}"


def _recipe_cell(run: Run, want: Recipe | None) -> str:
    """The table's short form of a run's recipe: what its crops run on, and `differs` (in yellow) where it
    is not the config's training input (named under the table, `recipe_lines`)."""
    from loadopt import recipe

    found = run.recipe
    if not found:
        return "-"
    if recipe.differences(found, want):
        return "[yellow]differs[/]"
    stored = str(found.get("stored", found.get("kind", "?"))).replace("whole frame ", "frames ")
    return escape(stored.replace(" <= ", "<=").replace(" px", "px")[:14])


def recipe_lines(results: ResultsFile) -> list[str]:
    """The config's recipe, then one line per measured setting of another recipe, naming the difference."""
    from loadopt import recipe
    from loadopt.bench.decision import recipe_exclusions

    if not results.recipe:
        return []
    lines = [f"recipe of the config: {recipe.describe(results.recipe)}"]
    for label, differences in recipe_exclusions(results).items():
        lines.append(f"{label}: another training input, never chosen by the decision or auto: {'; '.join(differences)}")
    return lines


def _bytes_from(run: Run) -> str:
    """The table's short form of a run's `bytes_source`: `local disk` or `tier NAME`."""
    source = run.bytes_source or ""
    return source.split(" (", 1)[0] if source else "-"


def not_run_lines(results: ResultsFile) -> list[str]:
    """One line per setting that did not run (unavailable, failed, not run), with its reason; printed
    under the table so that a long reason does not widen it."""
    return [f"{run.label}: {run.status}: {run.reason}" for run in results.runs if run.label not in results.ranking]


def bytes_source_lines(results: ResultsFile) -> list[str]:
    """Where the runs' bytes came from, in full, once per distinct source."""
    sources = sorted({r.bytes_source for r in results.runs if r.bytes_source})
    return [f"bytes from {source}" + ("; tier_bytes in results.json counts what crossed it" if
                                      source.startswith("tier") else "") for source in sources]


def probe_table(result: ProbeResult) -> Table:
    """One row per read pattern of `loadopt probe`."""
    table = Table(title=f"loadopt probe: {result['url']} (tier {result.get('tier', 'local')})", title_justify="left")
    for column in ("pattern", "block", "readers", "IOPS", "MB/s", "lat p50 ms", "lat p99 ms"):
        table.add_column(column, justify="left" if column == "pattern" else "right")
    for p in result["patterns"]:
        block = p["block_bytes"]
        size = f"{block / 1024:,.0f} KiB" if block < 1 << 20 else f"{block / (1 << 20):,.1f} MiB"
        if "skipped" in p:
            table.add_row(p["pattern"], size, str(p["concurrency"]), f"[yellow]skipped: {escape(p['skipped'])}[/]",
                          "", "", "")
            continue
        latency = ["-" if p[k] is None else f"{p[k]:,.3f}" for k in ("lat_p50_ms", "lat_p99_ms")]
        table.add_row(p["pattern"], size, str(p["concurrency"]), f"{p['iops']:,.0f}", f"{p['mb_per_s']:,.1f}",
                      *latency)
    return table


def backends_table(result: TiersRun) -> Table:
    """Every backend setting (rows) through every tier (columns): samples/s and accelerator utilisation of
    one accelerator, the tier's winner marked."""
    rows = [(row, row.backends) for row in result.tiers if row.backends is not None]
    table = Table(title="every backend through each tier (one accelerator, cold; * = the tier's decision)",
                  title_justify="left")
    table.add_column("backend setting", justify="left")
    for row, _ in rows:
        table.add_column(f"{row.name}: samples/s (AU)", justify="right")
    labels: list[str] = []
    for _, backends in rows:
        labels += [run.label.removesuffix(" via tier") for run in backends.runs
                   if run.label.removesuffix(" via tier") not in labels]
    for label in labels:
        cells = []
        for _, backends in rows:
            run = next((r for r in backends.runs if r.label.removesuffix(" via tier") == label), None)
            if run is None:
                cells.append("-")
            elif run.samples_per_s is None:
                cells.append(f"[yellow]{run.status}[/]")
            else:
                chosen = backends.decision is not None and backends.decision.label == run.label
                au = run.accelerator_utilisation
                cells.append(f"{'* ' if chosen else ''}{run.samples_per_s:,.0f}"
                             f"{f' ({au:.0%})' if au is not None else ''}")
        table.add_row(escape(label), *cells)
    return table


def bounded_lines(result: TiersRun) -> list[str]:
    """Per tier of `loadopt tiers` whose figures the storage under it bounded: why, and what its own figures say."""
    lines = []
    for row in result.tiers:
        if not row.bounded_by_base:
            continue
        base = row.base
        share = max((s for s in (base.probe_share, base.deciding_trial_share) if s is not None), default=None)
        why = (f" ({share:.0%} of the read time was the {base.storage}'s, past the tier's "
               f"own figures: an emulated tier can only slow the storage under it down)") if share is not None else ""
        lines.append(f"{row.name}: measured {row.accelerators_supported}, {row.bounded_by_base}{why}; "
                     f"its own figures predict {row.predicted_accelerators}")
    return lines


def run_bound_lines(results: ResultsFile) -> list[str]:
    """One line per bench run through an emulated tier whose figures the storage under the tier bounded."""
    return [f"{run.label}: {run.bounded_by_base}" for run in results.runs if run.bounded_by_base]


def backend_lines(result: TiersRun) -> list[str]:
    """Per tier: the decision and where the bytes came from; then the settings that did not run, and why."""
    lines = []
    for row in result.tiers:
        backends = row.backends
        if not backends:
            continue
        if backends.skipped:
            lines.append(f"{row.name}: backends not compared: {backends.skipped}")
            continue
        label, text = (backends.decision.label, backends.decision.text) if backends.decision else (None, None)
        sources = sorted({str(r.bytes_source) for r in backends.runs if r.bytes_source})
        ran = sum(1 for r in backends.runs if r.samples_per_s is not None)
        nothing = (f"nothing (interrupted by {backends.interrupted_by} after {ran} of {len(backends.runs)} "
                   "settings: no decision recorded)") if backends.interrupted_by else "nothing (no setting ran)"
        lines.append(f"{row.name}: auto picks {label or nothing}"
                     f"{'; ' + text if text else ''}; bytes from {', '.join(sources)}")
        for run in backends.runs:
            if run.samples_per_s is None:
                lines.append(f"  {row.name}, {run.label}: {run.status}: {run.reason}")
            elif run.bounded_by_base:
                lines.append(f"  {row.name}, {run.label}: {run.bounded_by_base}")
    return lines


def tiers_table(result: TiersRun) -> Table:
    """One row per tier of `loadopt tiers`."""
    from loadopt.report.data import stored_size  # numpy and the schema load only when a table is drawn

    table = Table(title=f"loadopt tiers: accelerators kept at AU >= {result.au_threshold:.0%}", title_justify="left")
    for column in ("tier", "measured", "predicted", "dataset", "delivered MB/s", "samples/s", "AU", "CPU load",
                   "$/month", "$/accelerator-month", "search"):
        table.add_column(column, justify="left" if column in ("tier", "search") else "right")
    for row in result.tiers:
        costs = (row.cost.per_month, row.cost_per_supported_accelerator)
        money = ["-" if cost is None else f"{cost:,.2f}" for cost in costs]
        au = "-" if row.accelerator_utilisation is None else f"{row.accelerator_utilisation:.1%}"
        load = "-" if row.cpu_load is None else f"{row.cpu_load:.0%}"
        table.add_row(escape(row.name), str(row.accelerators_supported), str(row.predicted_accelerators),
                      stored_size(row.capacity_tb), f"{row.delivered_mb_s:,.1f}",
                      f"{row.samples_per_s:,.0f}", au, load, *money, escape(row.measured_note))
    return table
