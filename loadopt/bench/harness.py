"""The harness: plays the training job against one loader and records a probe per batch.

For each batch it times, on the consumer side, the wait for the batch (the data stall), the copy to
the device and finishing there, and the accelerator step. The measured window starts when the
first batch after warm-up is asked for and ends when the last step has finished on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadopt.bench.accelerator import Accelerator
from loadopt.bench.metrics import BatchProbe, window_metrics
from loadopt.bench.monitor import ProcessTreeMonitor
from loadopt.device import DeviceTransfer
from loadopt.loaders.base import Loader
from loadopt.storage.tiers import tier_counters


@dataclass
class RepeatResult:
    metrics: dict[str, Any]
    probes: list[BatchProbe]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def run_repeat(loader: Loader, accelerator: Accelerator, transfer: DeviceTransfer, warmup_batches: int,
               measure_batches: int, on_batch: Callable[[int], None] | None = None) -> RepeatResult:
    """Iterate `warmup_batches + measure_batches` batches (across epochs as needed) and measure."""
    total = warmup_batches + measure_batches
    probes: list[BatchProbe] = []
    monitor = ProcessTreeMonitor()
    sizes = loader.dataset.sizes
    run_start = time.perf_counter()
    window_start = run_start
    bytes_read_start = loader.counters.bytes_read
    tier_start = tier_end = None
    skipped_start = len(loader.counters.skipped)
    batches = loader.host_batches()
    empty_epochs = 0
    try:
        while len(probes) < total:
            index = len(probes)
            if index == warmup_batches:
                if not monitor.running:  # (asked again when the warm-up ended exactly at an epoch's end)
                    monitor.start()
                bytes_read_start = loader.counters.bytes_read
                tier_start = tier_counters(getattr(loader.dataset, "fs", None))
            asked = time.perf_counter()
            if index == warmup_batches:
                window_start = asked
            try:
                batch = next(batches)
            except StopIteration:  # end of the epoch: the loader has moved to the next one
                empty_epochs = empty_epochs + 1 if loader.counters.batches == 0 else 0
                if empty_epochs > 1:
                    raise RuntimeError(f"loader {loader.name} produced no batches") from None
                batches = loader.host_batches()
                continue
            got = time.perf_counter()
            inputs, labels = loader.finish(batch, transfer)
            finished = time.perf_counter()
            compute = accelerator.step(inputs, labels)
            probes.append(BatchProbe(
                index=index, measured=index >= warmup_batches, start_s=asked - run_start, wait_s=got - asked,
                h2d=transfer.last.elapsed, h2d_bytes=transfer.last.nbytes, finish_s=finished - got,
                compute=compute, samples=len(batch.indices), sample_bytes=int(sizes[batch.indices].sum())))
            if on_batch is not None:
                on_batch(len(probes))
        accelerator.drain()
        wall = time.perf_counter() - window_start
        tier_end = tier_counters(getattr(loader.dataset, "fs", None))
    finally:
        batches.close()
        if monitor.running:
            monitor.stop()
    usage = monitor.usage
    assert usage is not None
    metrics = window_metrics(probes, wall, usage, loader.counters.bytes_read - bytes_read_start,
                             h2d_pinned=transfer.last.pinned, h2d_emulated=transfer.emulate,
                             device_idle_s=_device_idle(probes),
                             tokens_per_sample=getattr(loader.dataset, "seq_len", None))
    # Bytes that crossed the storage tier in the window (None on plain local disk: no tier wrapper),
    # beside the loader's own `bytes_read`: a backend that bypassed the tier would show far fewer.
    metrics["tier_bytes"] = tier_end["bytes"] - tier_start["bytes"] if tier_start and tier_end else None
    return RepeatResult(metrics, probes, loader.counters.skipped[skipped_start:])


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
