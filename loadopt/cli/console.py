"""What every `loadopt` command shares: the consoles, the one-line report of a user error, the `--set`
option, and the rich progress the long commands draw."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from loadopt.errors import LoadoptError, Terminated
from loadopt.progress import Reporter

if TYPE_CHECKING:
    from loadopt.schema.metrics import RepeatMetrics

# Piped or captured output gets a width that fits the results table instead of rich's 80 columns.
WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
console = Console(width=WIDTH, emoji=False)  # ":x" in a path or a name is text, not an emoji code
err_console = Console(stderr=True, width=WIDTH, emoji=False)

SetOption = typer.Option(None, "--set", help="Override a config key, e.g. --set workload.step_time_ms=40 "
                                             "(repeatable; the value is parsed as YAML).")
# Every command that opens the config's dataset takes it: a remote dataset's listing is saved on its first
# open and never refreshed by itself.
RelistOption = typer.Option(False, "--relist", help="List the dataset's files again and save the new listing (a "
                            "remote dataset's is saved on its first open and reused; a local ImageFolder's while "
                            "its folders are unchanged).")


@contextmanager
def user_errors() -> Iterator[None]:
    """A `LoadoptError` (something the user can fix) as one `error:` line per line of its message, and its
    exit code; anything else keeps its traceback."""
    try:
        yield
    except LoadoptError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None



def stopped(what: str, stop: KeyboardInterrupt, terminated: list[bool]) -> NoReturn:
    """Ctrl-C, or SIGTERM under `cli.process.terminate_as_interrupt`: one line, "interrupted (SIGINT) " and
    `what` (what it stopped before and what is kept), and the exit code a shell gives that signal."""
    signal_name = "SIGTERM" if isinstance(stop, Terminated) or terminated else "SIGINT"
    err_console.print(f"interrupted ({signal_name}) {what}", highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(Terminated.exit_code if signal_name == "SIGTERM" else 130) from None


class RichReporter(Reporter):
    """Draws the bench's progress: the dataset generation, then one bar per run."""

    def __init__(self, progress: Progress, terminated: list[bool] | None = None) -> None:
        self.progress = progress
        self.terminated = terminated if terminated is not None else []
        self._task: TaskID | None = None
        self._dataset_task: TaskID | None = None
        self._conversions: dict[str, TaskID] = {}

    def stop_if_terminated(self) -> None:
        """Raise `Terminated` again where it is safe: the signal handler's own raise can land where Python
        ignores exceptions (a logging lock released around a fork: "Exception ignored in ...")."""
        if self.terminated:
            raise Terminated()

    def dataset_progress(self, done: int, total: int) -> None:
        self.stop_if_terminated()
        if self._dataset_task is None:
            self._dataset_task = self.progress.add_task("generating the synthetic dataset", total=total)
        self.progress.update(self._dataset_task, completed=done)

    def conversion_progress(self, label: str, done: int, total: int) -> None:
        self.stop_if_terminated()
        if label not in self._conversions:
            self._conversions[label] = self.progress.add_task(f"converting for {label}", total=total)
        self.progress.update(self._conversions[label], completed=done)

    def run_started(self, label: str, total_batches: int) -> None:
        self.stop_if_terminated()
        self._task = self.progress.add_task(label, total=total_batches)

    def batch_done(self, done: int) -> None:
        self.stop_if_terminated()
        if self._task is not None:  # a batch is always of a run started
            self.progress.update(self._task, completed=done)

    def run_finished(self, label: str, metrics: RepeatMetrics | None, error: str | None) -> None:
        if error is not None:
            self.progress.console.print(f"[red]{escape(label)}: failed: {escape(error)}[/]", highlight=False)
        elif metrics is not None:
            from loadopt.bench.metrics import median
            from loadopt.schema.metrics import took_no_step

            idle = "no step" if took_no_step(metrics) else f"stall {median(metrics, 'stall_fraction') or 0.0:.0%}"
            self.progress.console.print(f"  {label}: {median(metrics, 'samples_per_s') or 0.0:,.0f} samples/s, {idle}",
                                        highlight=False)

    def line(self, text: str) -> None:
        self.progress.console.print(escape(text), highlight=False)

    def tuning_trial(self, label: str, outcome: str, samples_per_s: float | None, reason: str) -> None:
        rate = f"{samples_per_s:,.0f} samples/s" if samples_per_s is not None else "no rate"
        why = f" ({reason})" if reason and outcome != "ok" else ""
        self.progress.console.print(f"  [dim]tried {escape(label)}: {rate}, {outcome}{escape(why)}[/]", highlight=False)


class LineProgress(Progress):
    """The progress of long work where stderr is not a terminal (a log file, CI, a notebook's captured output): a
    line when a task of known size starts, one every `every_s` seconds while it runs, and one when it ends, in
    place of a bar that would show nothing until the end."""

    def __init__(self, console: Console, every_s: float = 5.0) -> None:
        super().__init__(console=console, disable=True)
        self.every_s = every_s
        self._said: dict[TaskID, tuple[float, str, bool]] = {}  # when, which description, whether it ended

    def add_task(self, description: str, start: bool = True, total: float | None = 100.0, completed: int = 0,
                 visible: bool = True, **fields: object) -> TaskID:
        task = super().add_task(description, start, total, completed, visible, **fields)
        self._say(task)
        return task

    def update(self, task_id: TaskID, **changes: object) -> None:
        super().update(task_id, **changes)  # type: ignore[arg-type]
        self._say(task_id)

    def _say(self, task_id: TaskID) -> None:
        task = self._tasks[task_id]
        if task.total is None:  # a status line, not an amount of work: its command prints what it finds itself
            return
        ended = task.completed >= task.total
        said = self._said.get(task_id)
        now = time.monotonic()
        if said is not None and said[2]:
            return  # its end is said once
        if said is not None and said[1] == task.description and not ended and now - said[0] < self.every_s:
            return
        self._said[task_id] = (now, task.description, ended)
        count = f"{task.completed:,.0f}/{task.total:,.0f}"
        state = "done" if ended else "started" if said is None and not task.completed else "at"
        self.console.print(f"{task.description}: {state} {count} ({task.elapsed or 0:.0f} s)", highlight=False,
                           markup=False, soft_wrap=True)


def progress_bar() -> Progress:
    """A rich bar on a terminal, else a line per stage as it starts, goes on and ends (`LineProgress`)."""
    if not err_console.is_terminal:
        return LineProgress(err_console)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)

