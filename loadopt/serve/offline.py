"""LoadGen's Offline scenario through a loader: every sample available at once, the eval recipe, each sample
once and the results in input order, the accelerator stepping each batch as it comes."""

from __future__ import annotations

import time

import numpy as np

from loadopt.device import DeviceTransfer
from loadopt.loaders.base import Loader
from loadopt.schema.serve import Offline
from loadopt.serve.step import ServingStep


def run_offline(loader: Loader, step: ServingStep, transfer: DeviceTransfer) -> Offline:
    """One pass over `loader` (built with the eval recipe, unshuffled, nothing dropped); the order checked."""
    seen: list[np.ndarray] = []
    failed: set[int] = set(loader.unreadable)
    first_result_s: float | None = None
    busy_s = 0.0
    start = time.perf_counter()
    with transfer.device_work():
        for batch in loader.host_batches():
            inputs, _ = loader.finish(batch, transfer)
            began = time.perf_counter()
            step.run(inputs)
            ended = time.perf_counter()
            busy_s += ended - began
            first_result_s = ended - start if first_result_s is None else first_result_s
            seen.append(batch.indices)
            failed.update(index for index, _ in batch.failures)
    seconds = time.perf_counter() - start
    order = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    expected = np.arange(len(loader.dataset))
    kept = np.setdiff1d(expected, np.asarray(sorted(failed), np.int64)) if failed else expected
    return Offline(samples=len(order), seconds=seconds, samples_per_s=len(order) / seconds if seconds > 0 else 0.0,
                   first_result_s=first_result_s or 0.0, accelerator_utilisation=busy_s / seconds if seconds else 0.0,
                   in_order=bool(np.array_equal(order, kept)))
