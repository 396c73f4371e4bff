"""`loadopt bench` in the inference scenarios (`workload.scenario` offline, server, single_stream): the run
(`run_serve_bench`) and its table, one row per request path, within 120 columns."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from loadopt.cli.console import RichReporter, console, err_console, progress_bar
from loadopt.errors import Terminated

if TYPE_CHECKING:
    from loadopt.config_models import Config
    from loadopt.schema.serve import ServeResults


def run_serve(cfg: Config, names: list[str] | None, out: str | None, quick: bool, slo_ms: float | None,
              convert: bool, terminated: list[bool], relist: bool = False) -> None:
    from loadopt.serve.scenarios import run_serve_bench

    with progress_bar() as progress:
        outcome = run_serve_bench(cfg, loaders=names, out=out, quick=quick, slo_ms=slo_ms, convert=convert,
                                  reporter=RichReporter(progress, terminated), relist=relist)
    results = outcome.results
    console.print(serve_table(results))
    for path in results.paths:
        if path.status != "ok":
            console.print(f"[yellow]{escape(path.label)}: {path.status}: {escape(path.reason)}[/]", highlight=False)
    console.print(f"[dim]{escape(_context(results))}[/]", highlight=False)
    if results.machine_load:
        console.print(f"[yellow]{escape(results.machine_load)}[/]", highlight=False)
    if outcome.json_path is not None:
        from loadopt.cli.reading import auto_report

        console.print(f"results: {outcome.json_path}", highlight=False)
        auto_report(outcome.json_path)
    if outcome.interrupted:
        signal_name = "SIGTERM" if terminated else "SIGINT"
        kept = ("the paths that finished were kept" if outcome.json_path is not None
                else "before any path finished: nothing was written")
        err_console.print(f"interrupted ({signal_name}): {kept}", highlight=False)
        raise typer.Exit(Terminated.exit_code if terminated else 130)
    if outcome.json_path is None:
        reasons = "; ".join(f"{p.label}: {p.reason}" for p in results.paths if p.reason)
        err_console.print(f"error: no request path could be measured ({reasons or 'none configured'}); nothing "
                          f"was written to {out or cfg.report.out}", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"[bold]{escape(results.summary)}[/]", highlight=False)


def _context(results: ServeResults) -> str:
    """The line under the table: what every row shares (latencies in ms; queue/prep/batch/step: their mean parts)."""
    parts = [f"{results.recipe}", f"step: {results.step}", f"device {results.device}"]
    if results.scenario == "server":
        parts[1:1] = [results.arrivals, results.batching, f"{results.workers} preprocessing threads"]
    return "; ".join(p for p in parts if p)


def serve_table(results: ServeResults) -> Table:
    table = Table(title=f"loadopt bench: {results.name}, {results.scenario} on {results.device} ({results.dataset})",
                  title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1),
                  collapse_padding=True)
    ok = [p for p in results.paths if p.status == "ok"]
    if results.scenario == "offline":
        columns = ["path", "samples/s", "first result s", "AU", "in order"]
        rows = [[p.label, f"{p.offline.samples_per_s:,.0f}", f"{p.offline.first_result_s:.2f}",
                 f"{p.offline.accelerator_utilisation:.0%}", "yes" if p.offline.in_order else "NO"]
                for p in sorted(ok, key=lambda p: -(p.offline.samples_per_s if p.offline else 0)) if p.offline]
    elif results.scenario == "single_stream":
        columns = ["path", "p50 ms", "p90 ms", "p99 ms", "preprocess ms", "compute ms", "errors"]
        rows = [[p.label, f"{s.p50_ms:.2f}", f"{s.p90_ms:.2f}", f"{s.p99_ms:.2f}", f"{s.parts.preprocess_ms:.2f}",
                 f"{s.parts.compute_ms:.2f}", str(s.errors)]
                for p in sorted(ok, key=lambda p: p.single_stream.p90_ms if p.single_stream else 0)
                if (s := p.single_stream) is not None]
    else:
        bound = results.slo_ms
        offered = {f"{p.server.offered_qps:,.0f}" for p in ok if p.server is not None}
        at = f"@{offered.pop()}/s " if len(offered) == 1 else "@target "
        columns = (["path"] + ([f"<={bound:g}ms qps", "its p99"] if bound is not None else []) +
                   [f"{at}p50", "p99", "p99.9", "got/s", "queue", "prep", "batch", "step", "AU"])
        rows = []
        for p in sorted(ok, key=_server_rank):
            point = p.server
            if point is None:
                continue
            best = p.best_within_slo
            head = ([f"{best.offered_qps:,.0f}" if best else "none", f"{best.p99_ms:.1f}" if best else "-"]
                    if bound is not None else [])
            parts = point.parts
            rows.append([p.label, *head, f"{point.p50_ms:.1f}", f"{point.p99_ms:.1f}", f"{point.p999_ms:.1f}",
                         f"{point.achieved_qps:,.0f}", f"{parts.queue_ms:.1f}", f"{parts.preprocess_ms:.1f}",
                         f"{parts.batch_ms:.1f}", f"{parts.compute_ms:.1f}", f"{point.accelerator_utilisation:.0%}"])
    for column in columns:
        table.add_column(column, justify="left" if column == "path" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table


def _server_rank(path) -> float:
    """Highest rate within the bound first; without a bound, the lowest p99."""
    if path.best_within_slo is not None:
        return -path.best_within_slo.offered_qps
    return path.server.p99_ms if path.server is not None else float("inf")
