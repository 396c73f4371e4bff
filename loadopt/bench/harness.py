"""The harness: plays the training job against one loader and records a probe per batch.

For each batch it times, on the consumer side, the wait for the batch, the copy to the device and
finishing there, and the accelerator step. The measured window ends when the last step has finished on
the device; it starts when the last warm-up step has (on CUDA: the host waits for it, then asks for the
first measured batch; on the emulated device: where that step ends on its clock, the host never held up).

The device works as a GPU does: the host takes batch i, queues its copy and finishing and launches its
step, and goes on to batch i+1 while the device runs them, at most `AHEAD` steps behind the host. On CUDA
the streams do that. On the CPU, the emulated device (`EmulatedAccelerator`, `DeviceTransfer(emulate=True)`)
runs each batch's copy and finishing on its stream's host thread (`EmulatedStream`) and its step on a clock
that starts the step when the batch is finished and the step before has ended. The accelerator is idle
only in the gaps between steps, and each gap is someone's (`BatchProbe.loader_stall_s`, `finish_stall_s`):
- the loader's, when the device went idle before the host held batch i. The finishing that follows the
  batch's arrival is the loader's too: a loader-bound job pays it whatever the finishing costs (without
  it each step would start that much earlier, after an equally long gap);
- the host finishing's, when the host held batch i already and the device waited for its copy and
  finishing (the finishing cannot keep up with the step), or for the host itself (it asked late).
A real model step on the CPU (`ModelStep`) runs on the host, after the batch's finishing, as a CPU
training loop does: there the gap before each step is its wait (the loader's) and its finishing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn

from loadopt.bench.accelerator import AHEAD, Accelerator, EmulatedAccelerator
from loadopt.bench.metrics import BatchProbe, window_metrics
from loadopt.bench.monitor import ProcessTreeMonitor
from loadopt.clock import sleep_until
from loadopt.device import DeviceTransfer, Elapsed, EmulatedStream, HostCopyDone, StreamWork, TransferTiming
from loadopt.loaders.base import HostBatch, Loader
from loadopt.schema.metrics import RepeatMetrics
from loadopt.storage.tiers.stack import tier_counters


@dataclass
class RepeatResult:
    metrics: RepeatMetrics
    probes: list[BatchProbe]
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Launched:
    """A batch whose copy, finishing and step are queued on the emulated device."""

    index: int
    measured: bool
    asked: float
    got: float
    samples: int
    sample_bytes: int
    work: StreamWork  # its copy and finishing; the result is the copy's TransferTiming


@dataclass
class _Window:
    """What one repeat saw: its probes, the measured window's wall time, and the loader's and the tier's
    byte counts where the window opened and closed."""

    probes: list[BatchProbe] = field(default_factory=list)
    wall_s: float = 0.0
    bytes_read_start: int = 0
    tier_start: dict[str, float] | None = None
    tier_end: dict[str, float] | None = None


def run_repeat(loader: Loader, accelerator: Accelerator, transfer: DeviceTransfer, warmup_batches: int,
               measure_batches: int, on_batch: Callable[[int], None] | None = None) -> RepeatResult:
    """Iterate `warmup_batches + measure_batches` batches (across epochs as needed) and measure."""
    monitor = ProcessTreeMonitor()
    skipped_start = len(loader.counters.skipped)
    window = _play(loader, accelerator, transfer, warmup_batches, measure_batches, monitor, on_batch)
    usage = monitor.usage
    assert usage is not None
    metrics = window_metrics(window.probes, window.wall_s, usage, loader.counters.bytes_read - window.bytes_read_start,
                             h2d_pinned=transfer.last.pinned, h2d_emulated=transfer.emulate,
                             device_idle_s=_device_idle(window.probes),
                             tokens_per_sample=getattr(loader.dataset, "seq_len", None))
    # Bytes that crossed the storage tier in the window (None on plain local disk: no tier wrapper),
    # beside the loader's own `bytes_read`: a backend that bypassed the tier would show far fewer.
    start, end = window.tier_start, window.tier_end
    metrics["tier_bytes"] = end["bytes"] - start["bytes"] if start and end else None
    return RepeatResult(metrics, window.probes, loader.counters.skipped[skipped_start:])


def _play(loader: Loader, accelerator: Accelerator, transfer: DeviceTransfer, warmup_batches: int,
          measure_batches: int, monitor: ProcessTreeMonitor, on_batch: Callable[[int], None] | None) -> _Window:
    """The batches of one repeat through the device, the monitor watching the measured window."""
    run_start = time.perf_counter()
    window_start = run_start
    window = _Window(bytes_read_start=loader.counters.bytes_read)
    batches = _Batches(loader)
    device = None
    if isinstance(accelerator, EmulatedAccelerator) and accelerator.clocked and transfer.emulate:
        device = _ClockedDevice(loader, accelerator, transfer, run_start)
    try:
        for index in range(warmup_batches + measure_batches):
            if device is not None and index == max(0, warmup_batches - 1):
                # Started while the device still runs the warm-up's steps: the monitor's first look at the
                # process tree takes the host milliseconds that would otherwise hold up the first measured
                # batch of a loader that makes its batches on the host (its CPU window one batch longer).
                monitor.start()
            if index == warmup_batches:
                if device is None:  # the warm-up's steps end before the window opens (the clock knows when)
                    accelerator.drain()
                if not monitor.running:
                    monitor.start()
                window.bytes_read_start = loader.counters.bytes_read
                window.tier_start = tier_counters(getattr(loader.dataset, "fs", None))
                window_start = time.perf_counter()
                if device is not None:
                    device.opened = window_start
            if device is not None:
                window.probes += device.take(index, batches, measured=index >= warmup_batches)
            else:
                window.probes.append(_serial_step(loader, accelerator, transfer, batches, index,
                                                  index >= warmup_batches, run_start))
            if on_batch is not None:
                on_batch(index + 1)
        if device is not None:
            window.probes += device.drain()
            window.wall_s = device.busy_until - (device.window_start or window_start)
        else:
            accelerator.drain()
            window.wall_s = time.perf_counter() - window_start
        window.tier_end = tier_counters(getattr(loader.dataset, "fs", None))
    finally:
        if device is not None:
            device.close()
        batches.close()
        if monitor.running:
            monitor.stop()
    return window


class NothingDelivered(Exception):
    """A run that delivered no sample (every one skipped under `dataset.on_error: skip`): an error, never a
    measured setting."""


class _Batches:
    """The loader's host batches, epoch after epoch: `take()` is the next one and when it was asked for. A batch
    whose every sample was skipped is passed over (its failures are counted): there is nothing to step on."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self._iterator: Iterator[HostBatch] = loader.host_batches()
        self._empty_epochs = 0
        self._delivered = False  # whether this epoch gave a sample yet

    def take(self) -> tuple[HostBatch, float, float]:
        """The next batch, with the host clock when it was asked for (after any epoch's end) and held."""
        while True:
            asked = time.perf_counter()
            try:
                batch = next(self._iterator)
            except StopIteration:  # end of the epoch: the loader has moved to the next one
                self._empty_epochs = 0 if self._delivered else self._empty_epochs + 1
                self._delivered = False
                if self._empty_epochs > 1:
                    self._nothing_delivered()
                self._iterator = self._loader.host_batches()
                continue
            if len(batch.indices) == 0:
                continue
            self._delivered = True
            return batch, asked, time.perf_counter()

    def _nothing_delivered(self) -> NoReturn:
        unreadable = len({path for path, _ in self._loader.counters.skipped})
        if unreadable:
            raise NothingDelivered(f"delivered no samples ({unreadable} unreadable file(s) skipped under "
                                   "dataset.on_error: skip)")
        raise RuntimeError(f"loader {self._loader.name} produced no batches")

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()


def _serial_step(loader: Loader, accelerator: Accelerator, transfer: DeviceTransfer, batches: _Batches, index: int,
                 measured: bool, run_start: float) -> BatchProbe:
    """One batch where the host finishes it and launches its step (CUDA: queued on the device; a model on the
    CPU: run here, after the finishing, as a CPU training loop does)."""
    batch, asked, got = batches.take()
    inputs, labels = loader.finish(batch, transfer)
    finished = time.perf_counter()
    compute = accelerator.step(inputs, labels)
    on_host = compute.events is None  # the CPU ran the step: the time before it is the device's idle time
    return BatchProbe(
        index=index, measured=measured, start_s=asked - run_start, wait_s=got - asked, h2d=transfer.last.elapsed,
        h2d_bytes=transfer.last.nbytes, finish_s=finished - got, compute=compute, samples=len(batch.indices),
        sample_bytes=int(loader.dataset.sizes[batch.indices].sum()),
        loader_stall_s=got - asked if on_host else None, finish_stall_s=finished - got if on_host else None,
        ended_s=time.perf_counter() - run_start if on_host else None)


class _ClockedDevice:
    """The emulated device of the module's docstring: the copy and finishing on an `EmulatedStream`, the steps
    on the accelerator's clock, the host at most `AHEAD` steps ahead."""

    def __init__(self, loader: Loader, accelerator: EmulatedAccelerator, transfer: DeviceTransfer,
                 run_start: float) -> None:
        self._loader, self._accelerator, self._transfer = loader, accelerator, transfer
        self._run_start = run_start
        self._stream = EmulatedStream()
        self._launched: deque[_Launched] = deque()
        self._copy_pending: HostCopyDone | None = None
        self.busy_until = run_start  # host clock: when the last step settled so far ends
        self.opened = run_start  # host clock: when the host opened the measured window
        self.window_start: float | None = None  # the later of that and the end of the last warm-up step

    def take(self, index: int, batches: _Batches, measured: bool) -> list[BatchProbe]:
        """Take the next batch and queue its copy, finishing and step; the probes of the steps settled to
        keep the host within `AHEAD` steps of the device."""
        if self._copy_pending is not None:  # the backend may reuse that buffer once the next batch is asked for
            self._copy_pending.synchronize()
        batch, asked, got = batches.take()
        copy_done = None
        if batch.borrowed:
            batch.copy_done = copy_done = HostCopyDone()
        self._copy_pending = copy_done
        loader, transfer = self._loader, self._transfer

        def finish() -> TransferTiming:
            try:
                loader.finish(batch, transfer)
                return transfer.last
            finally:
                if copy_done is not None:
                    copy_done.set()  # also when the finishing failed: the host must not wait forever

        self._launched.append(_Launched(index, measured, asked, got, len(batch.indices),
                                        int(loader.dataset.sizes[batch.indices].sum()), self._stream.submit(finish)))
        probes = []
        while len(self._launched) > AHEAD:
            probes.append(self._settle())
        return probes

    def drain(self) -> list[BatchProbe]:
        """Settle every step launched and wait until the last has ended."""
        probes = [self._settle() for _ in range(len(self._launched))]
        sleep_until(self.busy_until)
        return probes

    def close(self) -> None:
        self._stream.close()

    def _settle(self) -> BatchProbe:
        """The oldest launched step: its start and end on the clock once its batch is finished; the host
        waits until it has ended (the bound on how far the host runs ahead)."""
        launched = self._launched.popleft()
        timing: TransferTiming = launched.work.wait()
        ready = launched.work.ended_s
        if launched.measured and self.window_start is None:
            self.window_start = self.busy_until = max(self.busy_until, self.opened)
        idle_from = self.busy_until
        start, end = self._accelerator.launch(ready)
        gap = start - idle_from if launched.measured else 0.0
        host_late = min(gap, max(0.0, launched.asked - idle_from))
        loader_stall = gap - host_late if launched.got > idle_from else 0.0
        self.busy_until = end
        sleep_until(end)
        return BatchProbe(
            index=launched.index, measured=launched.measured, start_s=launched.asked - self._run_start,
            wait_s=launched.got - launched.asked, h2d=timing.elapsed, h2d_bytes=timing.nbytes,
            finish_s=launched.work.ended_s - launched.work.began_s, compute=Elapsed(end - start),
            samples=launched.samples, sample_bytes=launched.sample_bytes, loader_stall_s=loader_stall,
            finish_stall_s=gap - loader_stall, ended_s=end - self._run_start)


def _device_idle(probes: list[BatchProbe]) -> float | None:
    """On CUDA, the device's idle time between consecutive measured steps, read from their events."""
    measured = [p for p in probes if p.measured]
    if len(measured) < 2 or measured[0].compute.events is None:
        return None
    idle_ms = 0.0
    for before, after in zip(measured, measured[1:], strict=False):
        if before.compute.events is None or after.compute.events is None:  # steps timed on the host
            return None
        idle_ms += max(0.0, before.compute.events[1].elapsed_time(after.compute.events[0]))
    return idle_ms / 1000.0
