"""Progress callbacks of long work (a bench, a dataset's generation, a conversion, `loadopt tiers`): the CLI draws them
with rich, the library's own default ignores them. A leaf, so the CLI can subclass it without importing
the harness."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a leaf at run time: the CLI's help never imports pydantic for it
    from loadopt.schema.metrics import RepeatMetrics


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
