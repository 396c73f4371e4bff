"""Progress callbacks of long work (a bench, a dataset's generation, a conversion, `loadopt tiers`): the CLI draws them
with rich; a library call shows its own on stderr (`StderrProgress`). A leaf, so the CLI can subclass it without
importing the harness."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a leaf at run time: the CLI's help never imports pydantic for it
    from loadopt.schema.metrics import RepeatMetrics


log = logging.getLogger("loadopt")


class Reporter:
    """Progress callbacks of a bench; the CLI draws them with rich, the library ignores them."""

    def dataset_progress(self, done: int, total: int) -> None: ...

    def conversion_progress(self, label: str, done: int, total: int) -> None: ...

    def run_started(self, label: str, total_batches: int) -> None: ...

    def batch_done(self, done: int) -> None: ...

    def run_finished(self, label: str, metrics: RepeatMetrics | None, error: str | None) -> None: ...

    def line(self, text: str) -> None:
        """One finished step that has no metrics of its own (a serving path's runs), for a log or a terminal."""


class TiersProgress:
    """What `run_tiers` tells as it goes; the CLI prints it, the library ignores it."""

    def status(self, text: str) -> None:
        """What runs now (a progress bar's description)."""

    def line(self, text: str) -> None:
        """One finished step (the plan, a trial, a tier), for a log as much as for a terminal."""

    def bench_reporter(self) -> Reporter:
        """The reporter of the backends' runs through a tier (`loadopt bench`'s)."""
        return Reporter()


def quiet() -> bool:
    """Whether the library keeps stderr to itself: `LOADOPT_QUIET=1` (its INFO log lines stay)."""
    return os.environ.get("LOADOPT_QUIET", "").strip().lower() not in ("", "0", "false", "no")


class StderrProgress:
    """A library call's long work (`make_loader` generating or converting a dataset), as `datasets` shows its own: a
    bar on stderr where stderr is a terminal, else INFO log lines (when it starts, every `every_s` seconds, when it
    ends); nothing on stderr under `LOADOPT_QUIET=1`. Called as `progress(done, total)`."""

    def __init__(self, description: str, every_s: float = 5.0) -> None:
        self.description, self.every_s = description, every_s
        self.terminal = sys.stderr.isatty() and not quiet()
        self._said_at: float | None = None
        self._ended = False

    def __call__(self, done: int, total: int) -> None:
        if self._ended:
            return
        ended = total > 0 and done >= total
        if self.terminal:
            width = 30
            filled = int(width * done / total) if total else 0
            sys.stderr.write(f"\r{self.description} [{'#' * filled}{'.' * (width - filled)}] {done:,}/{total:,}"
                             + ("\n" if ended else ""))
            sys.stderr.flush()
        else:
            now = time.monotonic()
            if self._said_at is None or ended or now - self._said_at >= self.every_s:
                self._said_at = now
                log.info("%s: %s/%s", self.description, f"{done:,}", f"{total:,}")
        self._ended = ended
