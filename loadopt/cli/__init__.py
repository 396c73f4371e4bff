"""The `loadopt` command: thin typer commands over the library, rich progress and tables.

One module per group of commands (bench.py: bench, measure; results.py: report, doctor, explain;
storage.py: probe, tiers; data.py: make-dataset, convert), what they share in console.py (consoles,
user errors, progress) and process.py (logging, signals), their tables in tables.py. Each module
declares its commands on its own `app`; they are joined here with `add_typer`, in the order
`loadopt --help` lists them.

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

# One typer app per module, merged into this one (add_typer without a name adds the commands themselves).
for commands in (bench.app, results.app, data.app, storage.app):
    app.add_typer(commands)


def main() -> None:
    sys.excepthook = redacted_excepthook
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


__all__ = ["app", "main"]
