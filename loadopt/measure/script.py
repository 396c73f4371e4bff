"""`loadopt measure [--out DIR] [--every N] train.py ARGS`: measure an unmodified script.

Every iteration of a `torch.utils.data.DataLoader` or of a loadopt loader (`make_loader`: the `Loader`
base class) is measured, their `__iter__` patched for the run; a DataLoader or loader that a loadopt
backend iterates inside itself is not (the loop's batches are the backend's, not those of its parts).
At exit, also when the script raises or calls `sys.exit`, the verdict of each loader
is logged and the results are written to DIR (`measure.json`; under torchrun one file per rank and
rank 0's aggregate). The script's exit status is kept. Under torchrun:
`torchrun --nproc-per-node 4 -m loadopt measure train.py ARGS`. `python -m loadopt.measure ARGS`
is the same command (`main`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import runpy
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from loadopt.errors import LoadoptError
from loadopt.measure.measuring import Measurement

if TYPE_CHECKING:  # for its type only: `patch` imports it when it runs
    from loadopt.loaders.base import Loader

log = logging.getLogger("loadopt.measure")


class ScriptError(LoadoptError):
    """The script to measure cannot be run (missing, not a file)."""


class MeasureSession:
    """One Measurement per DataLoader or loadopt loader the script iterates, kept after the loader is gone."""

    def __init__(self, every: int | None = None, paths: bool = True) -> None:
        self.every = every
        self.paths = paths  # end with the most iterated DataLoader's pipeline on loadopt's paths (`measure.paths`)
        self.measurements: list[Measurement] = []
        self.subjects: list[Any] = []  # what each measurement measured, kept for the ending
        self._by_loader: weakref.WeakKeyDictionary[Any, Measurement] = weakref.WeakKeyDictionary()
        self._made_by_backends: weakref.WeakSet[Any] = weakref.WeakSet()  # DataLoaders a backend created
        self._originals: list[tuple[Any, str, Callable[..., Any]]] = []  # (class, method, its own)

    def measurement_for(self, loader: Any, name: str | None = None, device: Any = None) -> Measurement:
        found = self._by_loader.get(loader)
        if found is None:
            name = name or type(loader).__name__
            same = sum(1 for m in self.measurements if m.label.split(" #")[0] == name)
            # The verdict is logged once, at exit, not at the end of every epoch of every loader.
            found = Measurement(None, device=device, every=self.every,
                                label=name if not same else f"{name} #{same + 1}", summary=False)
            self._by_loader[loader] = found
            self.measurements.append(found)
            self.subjects.append(loader)
        return found

    def patch(self) -> None:
        """Measure every DataLoader and loadopt loader iteration from now on (until `unpatch`), but for the
        DataLoaders and loaders that a loadopt backend creates or iterates inside itself."""
        from torch.utils.data import DataLoader

        from loadopt.loaders.base import Loader

        dataloader_init, dataloader_iter, loader_iter = DataLoader.__init__, DataLoader.__iter__, Loader.__iter__
        session = self

        def made_dataloader(loader: Any, *args: Any, **kwargs: Any) -> None:
            dataloader_init(loader, *args, **kwargs)
            # Marked where it is made: a backend may iterate it on a thread whose stack shows no backend.
            if _inside_a_backend(loader):
                session._made_by_backends.add(loader)

        def measured_dataloader(loader: Any) -> Iterator[Any]:
            if loader in session._made_by_backends or _inside_a_backend(loader):
                return dataloader_iter(loader)  # a part of a backend: the loop iterates the backend
            return session.measurement_for(loader).iterate(lambda: dataloader_iter(loader))

        def measured_loader(loader: Any) -> Iterator[Any]:
            if _inside_a_backend(loader):
                return loader_iter(loader)
            setting = loader.describe()
            # where its batches land: a loadopt loader says so (a DataLoader's is found as the job runs)
            measurement = session.measurement_for(loader, f"{loader.name} ({setting})" if setting else loader.name,
                                                  loader.device)
            return _loader_pass(measurement, loader, lambda: loader_iter(loader))

        patches: list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]] = [
            (DataLoader, "__init__", dataloader_init, made_dataloader),
            (DataLoader, "__iter__", dataloader_iter, measured_dataloader),
            (Loader, "__iter__", loader_iter, measured_loader)]
        for cls, method, original, patched in patches:
            functools.update_wrapper(patched, original)
            setattr(cls, method, patched)  # on the class, doing what the original did around it
            self._originals.append((cls, method, original))

    def unpatch(self) -> None:
        for cls, method, original in reversed(self._originals):
            setattr(cls, method, original)
        self._originals = []

    def finish(self, out: str | os.PathLike[str] | None, wait_s: float = 30.0) -> Path | None:
        """Close what is still open, log each loader's verdict, write the results (per rank)."""
        from loadopt.measure.reporting import rank_info, results_document, write_ranked

        for m in self.measurements:
            m.close()
        measured = [(m.label, m.metrics()) for m in self.measurements]
        for m, (_, metrics) in zip(self.measurements, measured, strict=True):
            if metrics is not None:
                log.info("%s", m.summary())
        if not any(metrics for _, metrics in measured):
            log.warning("measure: the script iterated no torch DataLoader and no loadopt loader; nothing was measured")
        elif self.paths:
            self.end_with_paths(measured)
        if out is None:
            return None
        device = next((str(m.device) for m in self.measurements if m.device is not None), "cpu")
        rank, world_size = rank_info()
        path = write_ranked(out, results_document(measured, device), rank, world_size, wait_s, 1)
        log.info("measure: results in %s", path)
        return path


    def end_with_paths(self, measured: list[tuple[str, Any]]) -> None:
        """The most iterated torch DataLoader's pipeline on loadopt's paths (`measure.paths.ending`), logged."""
        from torch.utils.data import DataLoader

        from loadopt.measure.paths import ending, stall_of

        candidates = [(metrics.get("samples", 0) if isinstance(metrics, dict) else 0, subject, metrics)
                      for subject, (_, metrics) in zip(self.subjects, measured, strict=True)
                      if isinstance(subject, DataLoader) and metrics is not None]
        if not candidates:
            return
        _, loader, metrics = max(candidates, key=lambda c: c[0])
        try:
            lines = ending(loader, stall_of(metrics))
        except LoadoptError as exc:
            lines = [f"loadopt's paths for this loop: not run: {str(exc).splitlines()[0]}"]
        for line in lines:
            log.info("%s", line)


def _inside_a_backend(subject: Any) -> bool:
    """Whether `subject` (a DataLoader or loader being made or iterated) is so by a loadopt backend: code of
    loadopt.loaders, or a method of another loader (an outside backend's `__init__`, `produce`, or a bound
    thread target), rather than by the script."""
    from loadopt.loaders.base import Loader

    here = inspect.currentframe()
    frame: FrameType | None = here.f_back if here is not None else None  # the patched `__iter__`, then its caller
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("loadopt.loaders."):
            return True
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":  # a method: read only its first argument
            owner = frame.f_locals.get("self")
            if isinstance(owner, Loader) and owner is not subject:
                return True
        frame = frame.f_back
    return False


def _loader_pass(measurement: Measurement, loader: Loader[Any],
                 make_iterator: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """One measured pass over a loadopt loader; its stored bytes per delivered sample (its own counters)
    give the measurement's MB/s."""
    try:
        yield from measurement.iterate(make_iterator)
    finally:
        counters = loader.counters
        if counters.samples:
            measurement.sample_bytes = counters.bytes_delivered / counters.samples


def _script_exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # what Python does with `sys.exit("message")`
    return 1


def run_script(script: str, args: list[str], out: str | None, every: int | None = None,
               wait_s: float = 30.0, paths: bool = True) -> int:
    """Run `script` as `__main__` with `args`, every DataLoader and loadopt loader measured; returns its
    exit status. `paths`: end with the most iterated DataLoader's pipeline on loadopt's paths."""
    path = Path(script)
    if not path.is_file():
        raise ScriptError(f"{script}: no such script" if not path.exists() else f"{script}: not a file")
    if out is not None:
        from loadopt.files import prepare_output

        prepare_output(out)  # an unwritable folder fails now, not after the whole job has run
    session = MeasureSession(every, paths)
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
