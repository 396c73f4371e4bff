"""The measuring commands: `loadopt bench` (every configured loader setting through the harness, ranked)
and `loadopt measure` (an unmodified training script's DataLoader and loadopt loader iterations, measured in
place)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from loadopt.cli.console import (
    RelistOption,
    RichReporter,
    SetOption,
    console,
    err_console,
    progress_bar,
    stopped,
    user_errors,
)
from loadopt.cli.process import setup_logging, stop_that_came, terminate_as_interrupt
from loadopt.cli.tables import (
    bytes_source_lines,
    not_run_lines,
    recipe_lines,
    results_table,
    run_bound_lines,
    verdict_lines,
)
from loadopt.errors import ConfigError, Terminated, shown_name

if TYPE_CHECKING:
    from loadopt.bench.runner import BenchOutcome
    from loadopt.schema.documents import ResultsFile

app = typer.Typer()  # this module's commands; loadopt.cli joins it to the `loadopt` app


@app.command()
def bench(
    config: str = typer.Argument(..., help="A config YAML, or a bundled config by name (imagenet, serve, ...: "
                                           "`loadopt init --list`)."),
    loaders: str = typer.Option(None, "--loaders", help="Comma-separated backends to run.",
                                show_default="all configured"),
    out: str = typer.Option(None, "--out", help="Output folder.", show_default="report.out of the config"),
    quick: bool = typer.Option(False, "--quick", help="One short repeat per setting: a first look in < 2 minutes."),
    set_: list[str] = SetOption,
    no_convert: bool = typer.Option(False, "--no-convert", help="Fail instead of converting the dataset to a "
                                                                  "backend's format (e.g. Arrow) when it is missing."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log what loadopt decides and why."),
    tune: bool = typer.Option(False, "--tune", help="Search each backend's knobs (its own knob space; lists in the "
                                                    "config narrow it) and measure each backend's best setting."),
    budget: str = typer.Option("10m", "--budget", help="Time for the --tune search, e.g. 90s, 10m, 1h."),
    attribute_stages: bool = typer.Option(False, "--attribute-stages", help="Run the stages of each backend's best "
                                          "setting apart (loader warm and cold, storage read); implied by --tune."),
    slo_ms: float = typer.Option(None, "--slo-ms", min=0.001, help="workload.scenario server: search the highest "
                                 "request rate whose p99 latency stays within this many ms."),
    relist: bool = RelistOption,
    log_to: list[str] = typer.Option(None, "--log-to", help="Also record the table, the ceilings and the per-batch "
                                     "timeline in a tracker: tensorboard[:DIR], wandb[:PROJECT] or "
                                     "mlflow[:TRACKING_URI] (repeatable; each an extra, e.g. loadopt\\[tensorboard])."),
) -> None:
    """Run every configured loader setting through the harness and rank them.

    Examples:
      loadopt bench imagenet --quick              # a bundled config, from any folder
      loadopt bench my.yaml --loaders torch,arrow --set pipeline.batch_size=128
      loadopt bench serve --slo-ms 15             # the inference scenarios
    """
    from loadopt.bench.runner import run_bench
    from loadopt.config import load_config
    from loadopt.report.trackers import check_target

    setup_logging(verbose)
    interrupted: list[bool] = []  # Ctrl-C came (its KeyboardInterrupt may have been lost in a finaliser)
    with user_errors(), terminate_as_interrupt(interrupted) as terminated:
        from loadopt.bench.tuner import parse_budget

        cfg = load_config(config, set_ or [])
        budget_s = parse_budget(budget)
        for target in log_to or []:  # an unknown tracker or a missing package: its line before any work
            check_target(target)
        names = [n.strip() for n in loaders.split(",") if n.strip()] if loaders else None
        if cfg.workload.scenario != "train":  # the inference scenarios (loadopt/serve/)
            from loadopt.cli.serve import run_serve

            if tune or attribute_stages:
                flag = "--tune" if tune else "--attribute-stages"
                raise ConfigError(f"{flag} measures training input; {config} runs workload.scenario: "
                                  f"{cfg.workload.scenario} (its request paths are compared as configured)")

            run_serve(cfg, names, out, quick, slo_ms, not no_convert, terminated, relist)
            return
        if slo_ms is not None:
            raise ConfigError(f"--slo-ms bounds the server scenario's latency; {config} runs workload.scenario: "
                              "train (set workload.scenario: server)")
        with progress_bar() as progress:
            try:
                outcome = run_bench(cfg, loaders=names, out=out, quick=quick,
                                    reporter=RichReporter(progress, terminated), convert=not no_convert, tune=tune,
                                    budget_s=budget_s, attribute_stages=attribute_stages, return_errors=True,
                                    relist=relist, stop_requested=lambda: stop_that_came(terminated, interrupted))
            except KeyboardInterrupt as exc:  # before any run finished: the output folder is as it was
                stopped("before any run finished: no results were written", exc, terminated)
    results = outcome.results
    if results is None:  # a rank other than 0 under torchrun: rank 0 writes and prints
        return
    _print_results(results)
    report_failed = None
    if outcome.json_path is not None:
        console.print(f"results: {outcome.json_path}, per-batch timings: {outcome.parquet_path}", highlight=False)
        report_failed = _report(outcome.json_path)
    if outcome.json_path is not None:
        _log_to_trackers(outcome.json_path, log_to or [])
    if report_failed is not None and (outcome.interrupted or outcome.error is not None):  # their line is the one
        err_console.print(f"[yellow]warning:[/] {escape(report_failed)}", highlight=False)
        report_failed = None
    _close(outcome, results, bool(terminated), out or cfg.report.out)
    console.print(f"[bold]{results.summary}[/]", highlight=False)
    if report_failed is not None:  # the folder holds this bench's files and no report: the bench did not finish
        err_console.print(f"error: {report_failed}", highlight=False, markup=False, soft_wrap=True)
        raise typer.Exit(1)


def _log_to_trackers(json_path: Path, targets: list[str]) -> None:
    """The results just written, in each tracker of `--log-to`; a tracker that fails is a warning (the results are
    on disk, and `loadopt bench` says where)."""
    from loadopt.report.trackers import log_results

    for target in targets:
        try:
            console.print(f"logged to {target}: {log_results(json_path, target)}", highlight=False, markup=False)
        except Exception as exc:  # noqa: BLE001 - a tracker's own failure (a server down): said, the bench stands
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            err_console.print(f"warning: --log-to {target}: {why}", highlight=False, markup=False, soft_wrap=True)


def _report(json_path: Path) -> str | None:
    """The report beside the results just written (the earlier bench's was removed with them); the line of
    what went wrong when it could not be written (a full disk), else None."""
    from loadopt.report import write_report

    try:
        console.print(f"report: {write_report([json_path])}", highlight=False)
    except Exception as exc:  # noqa: BLE001 - the results are on disk: the report's failure is said, not raised
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        target = str(json_path.parent / "report.html")
        line = why if why.startswith(target) else f"{target}: cannot write the report ({why})"  # named once
        return (f"{line}; the results beside it are this bench's (no earlier report is left), `loadopt report "
                f"{json_path}` writes it again")
    return None


def _close(outcome: BenchOutcome, results: ResultsFile, terminated: bool, out: str) -> None:
    """The files skipped under on_error: skip, then the exit a stopped or failed bench owes its caller: 143 or
    130 when interrupted, the user error's one line, 1 when no setting could be measured."""
    skipped = {f.path: f.reason for r in results.runs for f in r.skipped_files}
    if skipped:
        listed = "; ".join(f"{shown_name(path)}: {why}" for path, why in list(skipped.items())[:5])
        more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        console.print(f"[yellow]{len(skipped)} unreadable file(s) skipped (dataset.on_error: skip): "
                      f"{escape(listed)}{more} (all in results.json, runs[i].skipped_files)[/]", highlight=False)
    left_out = results.dataset.left_out if results.dataset else []
    if left_out:
        console.print(f"[yellow]{len(left_out)} sample(s) left out when indexed (dataset.on_error: skip): "
                      f"{escape('; '.join(left_out[:5]))}{'; and more' if len(left_out) > 5 else ''} (all in "
                      "results.json, dataset.left_out)[/]", highlight=False)
    if outcome.interrupted:
        signal_name = results.interrupted_by or ("SIGTERM" if terminated else "SIGINT")
        err_console.print(f"interrupted ({signal_name}): the results of the runs that finished were kept",
                          highlight=False)
        raise typer.Exit(Terminated.exit_code if signal_name == "SIGTERM" else 130)
    if outcome.error is not None:  # a user error stopped the bench: the runs before it are written
        with user_errors():
            raise outcome.error
    if not results.ranking:  # every backend unavailable or failing: nothing answers the question asked
        reasons = "; ".join(f"{r.label}: {r.reason}" for r in results.runs if r.reason)
        err_console.print(f"error: no loader setting could be measured ({reasons or 'none configured'}); "
                          f"nothing was written to {out}", highlight=False, markup=False,
                          soft_wrap=True)
        raise typer.Exit(1)


def _print_results(results: ResultsFile) -> None:
    """The ranked table, the lines under it (settings not run, bytes' sources, recipes, the machine's load,
    unreliable ceilings, the cache), the verdicts and the tuning's summary."""
    console.print(results_table(results))
    for line in not_run_lines(results):
        console.print(f"[yellow]{escape(line)}[/]", highlight=False)
    for line in bytes_source_lines(results):
        console.print(f"[dim]{escape(line)}[/]", highlight=False)
    for line in run_bound_lines(results):
        console.print(f"[yellow]{escape(line)}[/]", highlight=False)
    for n, line in enumerate(recipe_lines(results)):
        console.print(f"[dim]{escape(line)}[/]" if n == 0 else f"[yellow]{escape(line)}[/]", highlight=False)
    console.print("[dim]peak mem: the process tree's proportional set size (shared pages counted once)[/]")
    load = results.machine.get("load") if results.machine else None
    busy = load["note"] if load else None
    if busy:
        console.print(f"[yellow]{escape(busy)}[/]", highlight=False)
    for run in results.runs:
        if run.ceiling is not None and run.ceiling.unreliable:
            console.print(f"[yellow]of ceiling, {escape(run.label)}: unreliable: {escape(run.ceiling.reason or '')}[/]",
                          highlight=False)
    cache_note = results.cache.note if results.cache else ""
    console.print(f"[dim]{cache_note}; device {results.device}"
                  f"{' (emulated host-to-device copy)' if results.device == 'cpu' else ''}[/]", highlight=False)
    _print_verdicts(results)
    tuning = results.tuning
    if tuning:
        console.print(f"[dim]tuning: {sum(b.tried for b in tuning.backends)} settings tried in "
                      f"{tuning.seconds:,.0f} s of a {tuning.budget_s:,.0f} s budget ({tuning.method})[/]",
                      highlight=False)
        for backend in tuning.backends:
            if backend.reason:
                console.print(f"[dim]  {backend.backend}: {escape(backend.reason)}[/]", highlight=False)


def _print_verdicts(results: ResultsFile) -> None:
    """The measured ceilings, then one bottleneck verdict per backend's best setting."""
    from loadopt.bench.attribution.verdicts import ceilings_summary

    if results.ceilings is not None:
        summary = ceilings_summary(results.ceilings)
        console.print(f"[dim]ceilings measured in this run: {escape(summary)}[/]", highlight=False)
    for line in verdict_lines(results):
        name, rest = line.split(": ", 1)
        console.print(f"[bold]{escape(name)}[/]: {escape(rest)}", highlight=False)
    if results.verdicts:
        console.print("[dim]each verdict in full, with what would lift its bound: `loadopt explain "
                      "RESULTS.json` or the report[/]", highlight=False)


# Everything after the script is the script's: its own options are not parsed as ours.
@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def measure(
    script: str = typer.Argument(..., help="The training script, run unmodified, e.g. train.py."),
    args: list[str] = typer.Argument(None, help="Its arguments (everything after the script is the script's)."),
    out: str = typer.Option("results/measure", "--out", help="Folder for measure.json."),
    every: int = typer.Option(None, "--every", help="Log a progress line every N steps."),
    rank_wait: float = typer.Option(30.0, "--rank-wait", help="Seconds rank 0 waits for the other ranks' files."),
    paths: bool = typer.Option(True, "--paths/--no-paths",
                               help="End with the loop's own pipeline (its dataset and transform) on loadopt's paths."),
) -> None:
    """Measure every torch DataLoader and loadopt loader iteration of an unmodified training script; keeps its
    exit status.

    Examples:
      loadopt measure train.py --epochs 1        # the script's own arguments follow it
      loadopt measure --no-paths train.py
    """
    from loadopt.measure.script import run_script, verdicts_on_stderr

    with user_errors(), verdicts_on_stderr():
        code = run_script(script, args or [], out, every, rank_wait, paths)
    raise typer.Exit(code)


