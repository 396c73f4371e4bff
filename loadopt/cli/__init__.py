"""The `loadopt` command: thin typer commands over the library, rich progress and tables.

One module per group of commands (bench.py: bench, measure; results.py: report, doctor, explain;
storage.py: probe, tiers; data.py: make-dataset, convert), what they share in console.py (consoles,
user errors, progress) and process.py (logging, signals), their tables in tables.py. Every command is
registered here, on `app`, in the order `loadopt --help` lists them.

User errors (`LoadoptError`) print one line on stderr and exit non-zero; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import sys

import typer

from loadopt.cli import bench, data, results, storage
from loadopt.cli.process import redacted_excepthook

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure and pick the fastest input path for a deep-learning job.")

app.command()(bench.bench)
app.command()(results.report)
app.command()(results.doctor)
app.command()(results.explain)
# Everything after the script is the script's: its own options are not parsed as ours.
app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})(bench.measure)
app.command("make-dataset")(data.make_dataset)
app.command()(data.convert)
app.command()(storage.probe)
app.command()(storage.tiers)


def main() -> None:
    sys.excepthook = redacted_excepthook
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


__all__ = ["app", "main"]
