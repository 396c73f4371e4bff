"""The `loadopt` command: thin typer commands over the library, rich progress and tables.

One module per group of commands (`bench`: bench, measure; `results`: report, doctor, explain;
`storage`: probe, tiers; `data`: make-dataset, convert), what they share in `console` (consoles,
user errors, progress) and `process` (logging, signals), their tables in `tables`. Each module
declares its commands on its own `app`; they are joined here with `add_typer`, in the order
`loadopt --help` lists them.

User errors (`LoadoptError`) print one line on stderr and exit non-zero; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from loadopt.cli import bench, data, reading, storage
from loadopt.cli.console import err_console
from loadopt.cli.process import redacted_excepthook

try:  # typer 0.2x carries its own click, whose errors derive from TyperException
    from typer import TyperException as ParameterProblem
except ImportError:  # older typer runs on click itself
    from click import ClickException as ParameterProblem  # type: ignore[assignment]


class OneLineUsageErrors(TyperGroup):
    """A bad option or argument (`--slo-ms -1`, a missing CONFIG) as one `error:` line naming the option and the
    command's help, like every other user error, instead of click's framed usage block."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except typer.Abort:
            sys.exit(1)
        except ParameterProblem as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `loadopt tiers` alone: the help, as asked
                getattr(exc, "show")()  # noqa: B009 - click's method, absent from typer's base class
                sys.exit(getattr(exc, "exit_code", 2))
            context = getattr(exc, "ctx", None)
            command = context.command_path if context is not None else "loadopt"
            message = " ".join(getattr(exc, "format_message")().split())  # noqa: B009 - as `show`
            err_console.print(f"[bold red]error:[/] {escape(command)}: {escape(message)} (see '{escape(command)} "
                              "--help')", highlight=False, soft_wrap=True)
            sys.exit(getattr(exc, "exit_code", 2))
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(cls=OneLineUsageErrors, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(asked: bool) -> None:
    if asked:
        from loadopt.version import __version__

        print(f"loadopt {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", "-V", callback=_print_version, is_eager=True,
                                          help="Print loadopt's version and exit.")) -> None:
    """Measure and pick the fastest input path for a deep-learning job.

    Examples:
      loadopt bench imagenet --quick     # a bundled config, from any folder
      loadopt init && loadopt bench imagenet.yaml
    """

# One typer app per module, merged into this one (add_typer without a name adds the commands themselves).
for commands in (bench.app, reading.app, data.app, storage.app):
    app.add_typer(commands)


def main() -> None:
    sys.excepthook = redacted_excepthook
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


__all__ = ["app", "main"]
