"""The `loadopt` command: thin typer commands over the library, rich progress and tables.

User errors (`LoadoptError`) print one line on stderr and exit non-zero; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadopt.cli_tables import bytes_source_lines, not_run_lines, recipe_lines, results_table
from loadopt.errors import LoadoptError, Terminated

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure and pick the fastest input path for a deep-learning job.")
# Piped or captured output gets a width that fits the results table instead of rich's 80 columns.
_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
console = Console(width=_WIDTH)
err_console = Console(stderr=True, width=_WIDTH)

SetOption = typer.Option(None, "--set", help="Override a config key, e.g. --set workload.step_time_ms=40 "
                                             "(repeatable; the value is parsed as YAML).")


@contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except LoadoptError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None


def _logging(verbose: bool) -> None:
    """Log to stderr, every record with its credentials redacted (storage/remote.py)."""
    from loadopt.storage.remote import RedactingFilter

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


@contextmanager
def _terminate_as_interrupt() -> Iterator[list[bool]]:
    """SIGTERM (Slurm, Kubernetes, `timeout`) stops the command as Ctrl-C does: `errors.Terminated`, a
    KeyboardInterrupt, is raised in the main thread once (a second SIGTERM is ignored, so the cleanup and
    the writing of the finished runs are not cut short). Yields a list holding True once it came."""
    import signal
    import threading

    received: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    owner = os.getpid()
    interrupted: list[bool] = []

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a forked worker inherited this handler: end it as SIGTERM always did
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if received:
            return
        received.append(True)
        raise Terminated()

    def unraisable(info: Any) -> None:  # our raise landed where Python ignores exceptions: raised again later
        if isinstance(info.exc_value, Terminated):
            return
        if received or interrupted:  # a finaliser of an object the stop cut short mid-construction (seen:
            # torch's DataLoader iterator without `_workers_status`): the stop is the cause, not a fault to print
            logging.getLogger("loadopt").debug("after the stop, ignored in %r: %r", info.object, info.exc_value)
            return
        previous_hook(info)

    def interrupt(signum: int, frame: Any) -> None:  # Ctrl-C as always, remembered for `unraisable`
        interrupted.append(True)
        signal.default_int_handler(signum, frame)

    previous, previous_hook = signal.signal(signal.SIGTERM, stop), sys.unraisablehook
    previous_int = signal.signal(signal.SIGINT, interrupt) if signal.getsignal(signal.SIGINT) is \
        signal.default_int_handler else None
    sys.unraisablehook = unraisable
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
        sys.unraisablehook = previous_hook


class RichReporter:
    """Draws the bench's progress: the dataset generation, then one bar per run."""

    def __init__(self, progress: Progress, terminated: list[bool] | None = None) -> None:
        self.progress = progress
        self.terminated = terminated if terminated is not None else []
        self._task: Any = None
        self._dataset_task: Any = None
        self._conversions: dict[str, Any] = {}

    def _stop_if_terminated(self) -> None:
        """Raise `Terminated` again where it is safe: the signal handler's own raise can land where Python
        ignores exceptions (a logging lock released around a fork: "Exception ignored in ...")."""
        if self.terminated:
            raise Terminated()

    def dataset_progress(self, done: int, total: int) -> None:
        self._stop_if_terminated()
        if self._dataset_task is None:
            self._dataset_task = self.progress.add_task("generating the synthetic dataset", total=total)
        self.progress.update(self._dataset_task, completed=done)

    def conversion_progress(self, label: str, done: int, total: int) -> None:
        self._stop_if_terminated()
        if label not in self._conversions:
            self._conversions[label] = self.progress.add_task(f"converting for {label}", total=total)
        self.progress.update(self._conversions[label], completed=done)

    def run_started(self, label: str, total_batches: int) -> None:
        self._stop_if_terminated()
        self._task = self.progress.add_task(label, total=total_batches)

    def batch_done(self, done: int) -> None:
        self._stop_if_terminated()
        self.progress.update(self._task, completed=done)

    def run_finished(self, label: str, metrics: dict[str, Any] | None, error: str | None) -> None:
        if error is not None:
            self.progress.console.print(f"[red]{escape(label)}: failed: {escape(error)}[/]", highlight=False)
        elif metrics is not None:
            self.progress.console.print(
                f"  {label}: {metrics['samples_per_s']:,.0f} samples/s, stall {metrics['stall_fraction']:.0%}",
                highlight=False)

    def tuning_trial(self, label: str, outcome: str, samples_per_s: float | None, reason: str) -> None:
        rate = f"{samples_per_s:,.0f} samples/s" if samples_per_s is not None else "no rate"
        why = f" ({reason})" if reason and outcome != "ok" else ""
        self.progress.console.print(f"  [dim]tried {escape(label)}: {rate}, {outcome}{escape(why)}[/]", highlight=False)


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False, disable=not err_console.is_terminal)


@app.command()
def bench(
    config: str = typer.Argument(..., help="The config YAML, e.g. configs/imagenet.yaml."),
    loaders: str = typer.Option(None, "--loaders", help="Comma-separated backends to run (default: all configured)."),
    out: str = typer.Option(None, "--out", help="Output folder (default: report.out of the config)."),
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
) -> None:
    """Run every configured loader setting through the harness and rank them."""
    from loadopt.bench.runner import run_bench
    from loadopt.config import load_config

    _logging(verbose)
    with user_errors(), _terminate_as_interrupt() as terminated:
        from loadopt.bench.tuner import parse_budget

        cfg = load_config(config, set_ or [])
        budget_s = parse_budget(budget)
        names = [n.strip() for n in loaders.split(",") if n.strip()] if loaders else None
        with progress_bar() as progress:
            try:
                outcome = run_bench(cfg, loaders=names, out=out, quick=quick,
                                    reporter=RichReporter(progress, terminated), convert=not no_convert, tune=tune,
                                    budget_s=budget_s, attribute_stages=attribute_stages)
            except Terminated:  # before any run started (generating, converting): nothing half-written is kept
                err_console.print("interrupted (SIGTERM) before any run finished: no results were written",
                                  highlight=False, markup=False)
                raise typer.Exit(Terminated.exit_code) from None
    if outcome.json_path is None:  # a rank other than 0 under torchrun: rank 0 writes and prints
        return
    results = outcome.results
    console.print(results_table(results))
    for line in not_run_lines(results):
        console.print(f"[yellow]{escape(line)}[/]", highlight=False)
    for line in bytes_source_lines(results):
        console.print(f"[dim]{escape(line)}[/]", highlight=False)
    for n, line in enumerate(recipe_lines(results)):
        console.print(f"[dim]{escape(line)}[/]" if n == 0 else f"[yellow]{escape(line)}[/]", highlight=False)
    console.print("[dim]peak mem: the process tree's proportional set size (shared pages counted once)[/]")
    busy = (results["machine"].get("load") or {}).get("note")
    if busy:
        console.print(f"[yellow]{escape(busy)}[/]", highlight=False)
    unreliable = [r for r in results["runs"] if (r.get("ceiling") or {}).get("unreliable")]
    for run in unreliable:
        console.print(f"[yellow]of ceiling, {escape(run['label'])}: unreliable: {escape(run['ceiling']['reason'])}[/]",
                      highlight=False)
    console.print(f"[dim]{results['cache']['note']}; device {results['device']}"
                  f"{' (emulated host-to-device copy)' if results['device'] == 'cpu' else ''}[/]", highlight=False)
    _print_verdicts(results)
    if results.get("tuning"):
        tuning = results["tuning"]
        console.print(f"[dim]tuning: {sum(b['tried'] for b in tuning['backends'])} settings tried in "
                      f"{tuning['seconds']:,.0f} s of a {tuning['budget_s']:,.0f} s budget ({tuning['method']})[/]",
                      highlight=False)
        for backend in tuning["backends"]:
            if backend.get("reason"):
                console.print(f"[dim]  {backend['backend']}: {escape(backend['reason'])}[/]", highlight=False)
    console.print(f"results: {outcome.json_path}, per-batch timings: {outcome.parquet_path}", highlight=False)
    auto_report(outcome.json_path)
    skipped = {f["path"]: f["reason"] for r in results["runs"] for f in r.get("skipped_files", [])}
    if skipped:
        listed = "; ".join(f"{path}: {why}" for path, why in list(skipped.items())[:5])
        more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        console.print(f"[yellow]{len(skipped)} unreadable file(s) skipped (dataset.on_error: skip): "
                      f"{escape(listed)}{more} (all in results.json, runs[i].skipped_files)[/]", highlight=False)
    if outcome.interrupted:
        signal_name = results.get("interrupted_by") or ("SIGTERM" if terminated else "SIGINT")
        err_console.print(f"interrupted ({signal_name}): the results of the runs that finished were kept",
                          highlight=False)
        raise typer.Exit(Terminated.exit_code if signal_name == "SIGTERM" else 130)
    if not results["ranking"]:  # every backend unavailable or failing: nothing answers the question asked
        reasons = "; ".join(f"{r['label']}: {r['reason']}" for r in results["runs"] if r.get("reason"))
        err_console.print(f"error: no loader setting could be measured ({reasons or 'none configured'})",
                          highlight=False, markup=False)
        raise typer.Exit(1)
    console.print(f"[bold]{results['summary']}[/]", highlight=False)


def _print_verdicts(results: dict[str, Any]) -> None:
    """The measured ceilings, then one bottleneck verdict per backend's best setting."""
    from loadopt.bench.attribution import ceilings_summary

    if results.get("ceilings"):
        console.print(f"[dim]ceilings measured in this run: {escape(ceilings_summary(results['ceilings']))}[/]",
                      highlight=False)
    for verdict in results.get("verdicts") or []:
        console.print(f"[bold]{escape(verdict['label'])}[/]: {escape(verdict['text'])}", highlight=False)


def auto_report(results_path: Any) -> None:
    """The report beside the results; the results are already on disk, so a failure here only warns."""
    from loadopt.report import write_report

    try:
        console.print(f"report: {write_report([results_path])}", highlight=False)
    except Exception as exc:  # noqa: BLE001 - the bench's results must survive any report failure
        err_console.print(f"[yellow]warning:[/] the report could not be written: "
                          f"{escape(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}", highlight=False)


@app.command()
def report(
    results: list[str] = typer.Argument(..., help="results.json / measure.json files (or their folders); "
                                                  "several are compared side by side, against the first."),
    out: str = typer.Option(None, "--out", help="Output file (default: report.html beside the first results file; "
                                                "markdown: printed)."),
    format_: str = typer.Option("html", "--format", help="html (one self-contained page) or markdown (a table and "
                                                         "the verdict, for a pull request)."),
) -> None:
    """Turn results into one self-contained HTML page with plots, or a short Markdown summary."""
    from loadopt.report import render_report, write_report

    with user_errors():
        if format_ == "markdown" and out is None:
            typer.echo(render_report(results, format_), nl=False)
            return
        path = write_report(results, out, format_)
    console.print(f"report: {path}", highlight=False)


@app.command()
def doctor() -> None:
    """What this machine offers: torch/CUDA, pinned memory, DALI, kvikio/GDS, shared memory, CPU, RAM."""
    from loadopt.doctor import run_checks

    table = Table(title="loadopt doctor", title_justify="left")
    table.add_column("item")
    table.add_column("status")
    table.add_column("detail")
    for check in run_checks():
        status = {True: "[green]ok[/]", False: "[yellow]unusable[/]", None: "[dim]info[/]"}[check.ok]
        table.add_row(escape(check.item), status, escape(check.detail))
    console.print(table)


@app.command()
def explain(
    target: str = typer.Argument(..., help="A config YAML (what backend=auto does here) or a results.json "
                                           "(from loadopt bench or loadopt.measure), or its folder."),
    set_: list[str] = SetOption,
) -> None:
    """Say which input path `make_loader(backend="auto")` picks here and why, or what a results file says."""
    from pathlib import Path

    from loadopt.config import load_config
    from loadopt.explain import explain_config, explain_results

    with user_errors():
        path = Path(target)
        text = explain_results(path) if path.is_dir() or path.suffix == ".json" else \
            explain_config(load_config(target, set_ or []))
    console.print(text, highlight=False, markup=False)


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def measure(
    script: str = typer.Argument(..., help="The training script, run unmodified, e.g. train.py."),
    args: list[str] = typer.Argument(None, help="Its arguments (everything after the script is the script's)."),
    out: str = typer.Option("results/measure", "--out", help="Folder for measure.json."),
    every: int = typer.Option(None, "--every", help="Log a progress line every N steps."),
    rank_wait: float = typer.Option(30.0, "--rank-wait", help="Seconds rank 0 waits for the other ranks' files."),
) -> None:
    """Measure every torch DataLoader iteration of an unmodified training script; keeps its exit status."""
    from loadopt.measure.script import run_script, verdicts_on_stderr

    with user_errors(), verdicts_on_stderr():
        code = run_script(script, args or [], out, every, rank_wait)
    raise typer.Exit(code)


# The storage commands (probe, tiers) and the dataset commands (make-dataset, convert) live in their own
# modules; importing them registers them on `app`.
from loadopt import cli_data, cli_storage  # noqa: E402,F401 - after `app` and the helpers it uses exist


def _redacted_excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    """A bug keeps its traceback, without the credentials a URL in it may hold."""
    import traceback

    from loadopt.storage.remote import redact

    sys.stderr.write(redact("".join(traceback.format_exception(kind, exc, tb))))


def main() -> None:
    sys.excepthook = _redacted_excepthook
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    # `python -m loadopt.cli`: this file runs as `__main__`, and the storage commands registered on the
    # app of the module `loadopt.cli` (imported by cli_storage); run that one.
    from loadopt.cli import main as registered_main

    registered_main()
