"""`loadopt measure [--out DIR] [--every N] train.py ARGS`: measure an unmodified script.

Every `torch.utils.data.DataLoader` iteration of the script is measured (its `__iter__` is patched
for the run); at exit, also when the script raises or calls `sys.exit`, the verdict of each loader
is logged and the results are written to DIR (`measure.json`; under torchrun one file per rank and
rank 0's aggregate). The script's exit status is kept. Under torchrun:
`torchrun --nproc-per-node 4 -m loadopt measure train.py ARGS`. `python -m loadopt.measure ARGS`
is the same command (`main`).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadopt.errors import LoadoptError

log = logging.getLogger("loadopt.measure")


class ScriptError(LoadoptError):
    """The script to measure cannot be run (missing, not a file)."""


class MeasureSession:
    """One Measurement per DataLoader the script iterates, kept after the loader itself is gone."""

    def __init__(self, every: int | None = None) -> None:
        self.every = every
        self.measurements: list[Any] = []
        self._by_loader: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._original: Callable[..., Iterator[Any]] | None = None

    def measurement_for(self, loader: Any) -> Any:
        from loadopt.measure.measuring import Measurement

        found = self._by_loader.get(loader)
        if found is None:
            name = type(loader).__name__
            same = sum(1 for m in self.measurements if m.label.split(" #")[0] == name)
            # The verdict is logged once, at exit, not at the end of every epoch of every loader.
            found = Measurement(None, every=self.every, label=name if not same else f"{name} #{same + 1}",
                                summary=False)
            self._by_loader[loader] = found
            self.measurements.append(found)
        return found

    def patch(self) -> None:
        """Measure every DataLoader iteration from now on (until `unpatch`)."""
        from torch.utils.data import DataLoader

        original = self._original = DataLoader.__iter__
        session = self

        def __iter__(loader: Any) -> Iterator[Any]:
            return session.measurement_for(loader).iterate(lambda: original(loader))

        __iter__.__wrapped__ = original  # type: ignore[attr-defined]
        # a method patched on the class, yielding what the original did: not the declared iterator type
        DataLoader.__iter__ = __iter__  # type: ignore[method-assign, assignment]

    def unpatch(self) -> None:
        from torch.utils.data import DataLoader

        if self._original is not None:
            DataLoader.__iter__ = self._original  # type: ignore[method-assign, assignment]  # restored as above
            self._original = None

    def finish(self, out: str | os.PathLike[str] | None, wait_s: float = 30.0) -> Path | None:
        """Close what is still open, log each loader's verdict, write the results (per rank)."""
        from loadopt.measure.results import rank_info, results_document, write_ranked

        for m in self.measurements:
            m.close()
        measured = [(m.label, m.metrics()) for m in self.measurements]
        for m, (_, metrics) in zip(self.measurements, measured, strict=True):
            if metrics is not None:
                log.info("%s", m.summary())
        if not any(metrics for _, metrics in measured):
            log.warning("measure: the script iterated no torch DataLoader; nothing was measured")
        if out is None:
            return None
        device = next((str(m.device) for m in self.measurements if m.device is not None), "cpu")
        rank, world_size = rank_info()
        path = write_ranked(out, results_document(measured, device), rank, world_size, wait_s, 1)
        log.info("measure: results in %s", path)
        return path


def _script_exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # what Python does with `sys.exit("message")`
    return 1


def run_script(script: str, args: list[str], out: str | None, every: int | None = None,
               wait_s: float = 30.0) -> int:
    """Run `script` as `__main__` with `args`, every DataLoader measured; returns its exit status."""
    path = Path(script)
    if not path.is_file():
        raise ScriptError(f"{script}: no such script" if not path.exists() else f"{script}: not a file")
    if out is not None:
        from loadopt.files import prepare_output

        prepare_output(out)  # an unwritable folder fails now, not after the whole job has run
    session = MeasureSession(every)
    session.patch()
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [str(path), *args]
    if sys.path:  # as `python train.py` would: the script's folder first on the path
        sys.path[0] = str(path.resolve().parent)
    code = 0
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = _script_exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: BLE001 - the script's own failure: shown as Python would, then summarised
        traceback.print_exc()
        code = 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        session.unpatch()
    session.finish(out, wait_s)
    return code


@contextmanager
def verdicts_on_stderr() -> Iterator[None]:
    """For the zero-code form only (a library leaves logging to its user): the verdicts on stderr."""
    # Our own handler on our own logger: the script may configure the root logger as it likes, and
    # a script that configures nothing still shows the verdict on stderr.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    """`python -m loadopt.measure ARGS`: `loadopt measure ARGS`; returns the exit status."""
    from loadopt.cli import app

    args = sys.argv[1:] if argv is None else argv
    try:
        app(["measure", *args], prog_name="python -m loadopt")
    except SystemExit as exc:  # the command ends with the script's exit status, a usage error with 2
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return 0
