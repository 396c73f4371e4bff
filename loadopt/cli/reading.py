"""The commands that read what loadopt measured or would do: `loadopt report` (results as an HTML page or
Markdown), `loadopt explain` (what `backend="auto"` picks here and why, or what a results file says) and
`loadopt doctor` (what this machine offers)."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from loadopt.cli.console import RelistOption, SetOption, console, err_console, user_errors

app = typer.Typer()  # this module's commands; loadopt.cli joins it to the `loadopt` app


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
    out: str = typer.Option(None, "--out", help="Output file.",
                            show_default="report.html beside the first results file; markdown: printed"),
    format_: str = typer.Option("html", "--format", help="html (one self-contained page) or markdown (a table and "
                                                         "the verdict, for a pull request)."),
) -> None:
    """Turn results into one self-contained HTML page with plots, or a short Markdown summary.

    Examples:
      loadopt report results/imagenet/results.json
      loadopt report results/imagenet/results.json --format markdown
    """
    from loadopt.report import render_report, write_report

    with user_errors():
        if format_ == "markdown" and out is None:
            typer.echo(render_report(results, format_), nl=False)
            return
        path = write_report(results, out, format_)
    console.print(f"report: {path}", highlight=False)


@app.command()
def doctor(
    constraints: bool = typer.Option(False, "--constraints", help="Print only pip's constraint lines that keep this "
                                     "machine's torch and numpy while a peer library installs, and stop."),
) -> None:
    """What this machine offers: torch/CUDA, pinned memory, DALI, kvikio/GDS, shared memory, CPU, RAM.

    Examples:
      loadopt doctor
      loadopt doctor --constraints > keep.txt && pip install 'loadopt[litdata]' -c keep.txt
    """
    from loadopt.doctor import peers_constraints, run_checks

    if constraints:
        print(peers_constraints(), end="")
        return

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
    relist: bool = RelistOption,
) -> None:
    """Say which input path `make_loader(backend="auto")` picks here and why, or what a results file says.

    Examples:
      loadopt explain imagenet                   # what backend="auto" picks here
      loadopt explain results/imagenet/results.json
    """
    from pathlib import Path

    from loadopt.config import load_config
    from loadopt.explain import explain_config, explain_results

    with user_errors():
        path = Path(target)
        text = explain_results(path) if path.is_dir() or path.suffix == ".json" else \
            explain_config(load_config(target, set_ or []), relist)
    console.print(text, highlight=False, markup=False)
