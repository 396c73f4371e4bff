"""`loadopt.measure`: the input stalls of an existing training loop, measured in place.

    for images, labels in loadopt.measure(loader):      # the one changed line
        ...                                             # the loop body, as it was

Per step it records the wait (asking for batch i -> holding it) and the step (handing batch i out ->
asking for batch i+1) with `perf_counter_ns` into array-backed storage; everything else (percentiles,
the verdict) is computed when a summary is asked for. On a GPU the device's busy and idle time come
from CUDA events read back a few steps late, never a per-step sync.

For loops that are not a plain `for`:

    with loadopt.measure_steps() as m:
        while ...:
            batch = next(it); m.batch(batch)    # the wait ends, the step begins
            train_step(batch); m.step()         # the step ends, the wait for the next batch begins

or as a decorator on the step function: `@m` makes each call one step and the time between calls
the wait.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from loadopt.errors import LoadoptError
from loadopt.measure.batch_structure import count_samples, rebuilt, tensors_of
from loadopt.measure.reporting import (
    MeasureResults,
    Recorded,
    rank_info,
    recorded_metrics,
    results_document,
    verdict,
    write_json,
)
from loadopt.measure.reporting import write_ranked as _write_ranked
from loadopt.schema.metrics import RepeatMetrics

log = logging.getLogger("loadopt.measure")
F = TypeVar("F", bound=Callable[..., Any])
_clock = time.perf_counter_ns


class Measurement:
    """Records the waits and steps of a loop; iterate it (when it wraps an iterable), use it as a
    context manager, or decorate a step function with it. See the module docstring."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, device: Any = None, every: int | None = None,
                 label: str | None = None, samples: Callable[[Any], int] | None = None,
                 sample_bytes: float | None = None, out: str | os.PathLike[str] | None = None,
                 summary: bool = True, rank_wait_s: float = 30.0) -> None:
        self._iterable = iterable
        self.label = label or (type(iterable).__name__ if iterable is not None else "steps")
        self._requested_device = device
        self.device: Any = None  # resolved when the first iteration starts
        self.every = every if every and every > 0 else None
        self._count = samples or count_samples
        self.sample_bytes = sample_bytes
        self.out = out
        self.log_summary = summary
        self.rank_wait_s = rank_wait_s
        self._wait, self._step, self._samples = array("q"), array("q"), array("q")
        self._t_request = 0  # the wait in progress began here (while the window is open)
        self._t_batch: int | None = None  # the step in progress began here
        self._open = False
        self._next_line = self.every
        self._cuda: Any = None
        self._monitor: Any = None
        self._cpu_s: float | None = None
        self._storage_read = self._peak_rss = self._peak_pss = 0
        self._transfer: Any = None
        self._h2d_bytes, self._h2d_host_s, self._h2d_pinned = 0, 0.0, False
        self._unmarked = 0
        self._writes = 0

    # -- the hot path: a clock read and array appends per mark ------------------------------------

    def _got(self, t: int, batch: Any) -> None:
        self._wait.append(t - self._t_request)
        self._samples.append(self._count(batch))
        self._t_batch = t
        if self._cuda is not None:
            self._cuda.step_begins()

    def _request(self, t: int, step_began: int) -> None:
        self._step.append(t - step_began)
        self._t_batch = None
        self._t_request = t
        if self._cuda is not None:
            self._cuda.step_ends()
        if len(self._step) == self._next_line:
            self._periodic()

    def __iter__(self) -> Iterator[Any]:
        if self._iterable is None:
            raise TypeError("this measurement wraps no iterable: use loadopt.measure(iterable)")
        return self.iterate(functools.partial(iter, self._iterable))

    def iterate(self, make_iterator: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """Yield the batches of `make_iterator()` unchanged, measured. The iterator is made inside the
        first wait: starting workers is part of what the loop waits for."""
        if self._open:  # iterated twice at once: the second runs unmeasured rather than garble the first
            log.debug("%s: already being iterated; this iteration is not measured", self.label)
            yield from make_iterator()
            return
        self._begin()
        try:
            iterator = make_iterator()
            while True:
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                got = _clock()
                self._got(got, batch)
                yield batch
                self._request(_clock(), got)
        finally:
            # Normal end, `break` (GeneratorExit) or an exception from the wrapped iterable, which
            # propagates unchanged: the window closes in every case.
            self._end(_clock())

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # `m.sampler`, `m.set_epoch(...)`, ...: the wrapper stands in for the wrapped loader.
        iterable = self.__dict__.get("_iterable")
        if iterable is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(iterable, name)

    # -- windows: one per iteration (or `with` block) -----------------------------------------------

    def _begin(self) -> int:
        self._open = True
        if self.device is None:
            self.device = _resolve(self._requested_device)
        if self.device.type == "cuda" and self._cuda is None:
            from loadopt.measure.cuda import CudaTimeline

            self._cuda = CudaTimeline(self.device)
        self._start_monitor()
        if self._cuda is not None:
            self._cuda.window_begins()
        self._t_batch = None
        self._t_request = t = _clock()  # after the monitor's start, which costs a few ms
        return t

    def _end(self, t: int) -> None:
        if not self._open:
            return
        if self._t_batch is not None:
            self._step.append(t - self._t_batch)
            if self._cuda is not None:
                self._cuda.step_ends()
        self._t_batch, self._t_request = None, 0
        if self._cuda is not None:
            synced = _clock()
            self._cuda.drain()
            if self._step:  # the device was still working on the last step until now
                self._step[-1] += _clock() - synced
        self._stop_monitor()
        self._open = False
        # This runs in the wrapper's `finally`, maybe while the loader's own exception propagates:
        # reporting must neither replace that exception nor stop a training job at an epoch's end.
        try:
            if self.log_summary and self._step:
                log.info("%s", self.summary())
            if self.out is not None:
                self.write(self.out)
        except LoadoptError as exc:
            log.error("measure: %s", exc)
        except Exception:  # noqa: BLE001 - a fault of ours must not take down the job it measures
            log.exception("measure %s: could not report", self.label)

    def _start_monitor(self) -> None:
        from loadopt.bench.monitor import ProcessTreeMonitor

        # CPU time is exact whatever the interval (process and reaped-children times); the thread
        # only samples memory and live workers, so twice a second (PSS every 10 s) is plenty and
        # costs the job well under 0.1% of a core.
        self._monitor = ProcessTreeMonitor(interval_s=0.5, pss_every=20, pss_at_edges=False).start()

    def _stop_monitor(self) -> None:
        if self._monitor is None:
            return
        self._monitor.stop()
        usage, self._monitor = self._monitor.usage, None
        self._cpu_s = (self._cpu_s or 0.0) + usage.cpu_seconds
        self._storage_read += usage.storage_bytes_read
        self._peak_rss = max(self._peak_rss, usage.peak_rss_bytes)
        self._peak_pss = max(self._peak_pss, usage.peak_pss_bytes)

    def _periodic(self) -> None:
        n, every = len(self._step), self.every or 0
        self._next_line = n + every
        waits = np.frombuffer(self._wait, dtype=np.int64)[n - every:n]
        steps = np.frombuffer(self._step, dtype=np.int64)[n - every:n]
        wall = (waits.sum() + steps.sum()) / 1e9
        samples = int(np.frombuffer(self._samples, dtype=np.int64)[n - every:n].sum())
        rate, waited = (samples / wall, waits.sum() / 1e9 / wall) if wall > 0 else (0.0, 0.0)
        log.info("measure %s: step %d: %s samples/s, waited for data %.0f%% of the last %d steps (max wait %.1f ms)",
                 self.label, n, f"{rate:,.0f}", 100.0 * waited, every, waits.max() / 1e6)

    # -- manual marks and the decorator ------------------------------------------------------------

    def __enter__(self) -> Measurement:
        if not self._open:
            self._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end(_clock())

    def close(self) -> None:
        """End the measured window (logs the verdict, writes `out`), as leaving `with` does."""
        self._end(_clock())

    def batch(self, batch: Any = None) -> None:
        """The batch is in hand: the wait ends and the step begins (`batch` gives the sample count)."""
        t = _clock()
        if not self._open:
            t = self._begin()
        elif self._t_batch is not None:  # two batches without a step() between: the step ended here
            self._request(t, self._t_batch)
        self._got(t, batch)

    def step(self) -> None:
        """The step is done: it ends and the wait for the next batch begins."""
        t = _clock()
        if not self._open:
            self._begin()
            return
        step_began = self._t_batch
        if step_began is None:  # no batch() since the last step: its wait is unknown
            self._unmarked += 1
            step_began = self._t_request
            self._got(step_began, None)
        self._request(t, step_began)

    def __call__(self, fn: F) -> F:
        """Decorate a step function: each call is one step (its first argument the batch), the time
        between calls the wait. Outside `with`, the window starts at the first call."""

        @functools.wraps(fn)
        def measured_step(*args: Any, **kwargs: Any) -> Any:
            self.batch(args[0] if args else next(iter(kwargs.values()), None))
            try:
                return fn(*args, **kwargs)
            finally:
                self.step()

        return measured_step  # type: ignore[return-value]

    # -- moving batches to the device --------------------------------------------------------------

    def to_device(self, batch: Any, device: Any = None) -> Any:
        """Move the batch's tensors (nested in tuples, lists, dicts) to the device, timing the copy
        (h2d_gb_per_s, h2d_pinned); on CUDA a side-stream copy timed with events, read back late."""
        from loadopt.device import DeviceTransfer

        if device is not None:
            target = _resolve(device)
        else:  # where this measurement trains (resolved at its first iteration), else the default
            target = self.device if self.device is not None else _resolve(self._requested_device)
        if self._transfer is None or self._transfer.device != target:
            self._transfer = DeviceTransfer(target)
        tensors: list[Any] = []
        tensors_of(batch, tensors)
        if not tensors:
            return batch
        moved = self._transfer.to_device(*tensors)
        last = self._transfer.last
        if not last.nbytes:  # already there: nothing moved, hand the batch back as it is
            return batch
        self._h2d_bytes += last.nbytes
        self._h2d_pinned = last.pinned
        if last.elapsed.events is not None and self._cuda is not None:
            self._cuda.add_h2d(last.elapsed.events)
        else:
            self._h2d_host_s += last.elapsed.seconds()
        return rebuilt(batch, iter(moved))

    # -- results -----------------------------------------------------------------------------------

    def recorded(self) -> Recorded:
        n = len(self._step)
        cuda = self._cuda
        on_device = cuda is not None and cuda.steps_read > 0
        h2d_s = self._h2d_host_s + (cuda.h2d_ms / 1000.0 if cuda is not None else 0.0)
        return Recorded(
            wait_ns=np.frombuffer(self._wait, dtype=np.int64)[:n].copy(),
            step_ns=np.frombuffer(self._step, dtype=np.int64)[:n].copy(),
            samples=np.frombuffer(self._samples, dtype=np.int64)[:n].copy(), sample_bytes=self.sample_bytes,
            cpu_seconds=self._cpu_s, storage_bytes_read=self._storage_read, peak_rss_bytes=self._peak_rss,
            peak_pss_bytes=self._peak_pss, h2d_bytes=self._h2d_bytes, h2d_s=h2d_s, h2d_pinned=self._h2d_pinned,
            device_busy_s=cuda.busy_ms / 1000.0 if on_device else None,
            device_idle_s=cuda.idle_ms / 1000.0 if on_device else None, unmarked_waits=self._unmarked)

    def metrics(self) -> RepeatMetrics | None:
        """The flat metrics so far (None before the first complete step)."""
        if self._open and self._monitor is not None:  # fold the running window's CPU and memory in
            self._stop_monitor()
            self._start_monitor()
        if not self._step:
            return None
        return recorded_metrics(self.recorded())

    def summary(self) -> str:
        """The verdict paragraph for what has been measured so far."""
        metrics = self.metrics()
        return verdict(metrics, self.label) if metrics is not None else f"measure {self.label}: no step measured yet"

    def results(self) -> MeasureResults:
        """The results document (the shape of `loadopt bench`'s results.json; `schema.as_dict` gives its data)."""
        return results_document([(self.label, self.metrics())], str(self.device or "cpu"))

    def to_json(self, path: str | os.PathLike[str]) -> Path:
        """Write this process's results to `path` (atomically)."""
        return write_json(path, self.results())

    def write(self, folder: str | os.PathLike[str]) -> Path:
        """Into `folder`: `measure.json`, or under torchrun `measure-rank<r>.json` per rank and, on
        rank 0, `measure.json` gathering every rank with the slowest named."""
        self._writes += 1
        rank, world_size = rank_info()
        return _write_ranked(folder, self.results(), rank, world_size, self.rank_wait_s, self._writes)


def _resolve(device: Any) -> Any:
    """An explicit device as asked; by default CUDA only when the job has already initialised it
    (so a CPU job on a GPU machine is not given a CUDA context it never wanted)."""
    import torch

    from loadopt.device import resolve_device

    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu")
    return resolve_device(device)


def measure(iterable: Iterable[Any], *, device: Any = None, every: int | None = None, label: str | None = None,
            samples: Callable[[Any], int] | None = None, sample_bytes: float | None = None,
            out: str | os.PathLike[str] | None = None, summary: bool = True) -> Measurement:
    """Wrap any iterable of batches; iterating the result yields the same batches, measured.

    device: where the job trains (default: CUDA if the job has initialised it, else the CPU).
    every: log a line every N steps. samples: batch -> sample count (default: the first tensor's
    length). sample_bytes: stored bytes per sample, for mb_per_s. out: a folder to write the
    results into at the end of each iteration (per rank under torchrun). summary: log the verdict
    at the end of each iteration.
    """
    return Measurement(iterable, device=device, every=every, label=label, samples=samples,
                       sample_bytes=sample_bytes, out=out, summary=summary)


def measure_steps(*, device: Any = None, every: int | None = None, label: str = "steps",
                  samples: Callable[[Any], int] | None = None, sample_bytes: float | None = None,
                  out: str | os.PathLike[str] | None = None, summary: bool = True) -> Measurement:
    """A measurement driven by marks (`m.batch(b)`, `m.step()`), as a context manager or a decorator."""
    return Measurement(None, device=device, every=every, label=label, samples=samples, sample_bytes=sample_bytes,
                       out=out, summary=summary)


__all__ = ["Measurement", "count_samples", "measure", "measure_steps"]
