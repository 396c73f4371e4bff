"""Shared by the benchmark scripts: the RESULT line, building loaders from a config, timing rounds."""

from __future__ import annotations

import operator
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def result_line(name: str, ratio: float, op: str, target: float) -> str:
    """`RESULT <name> ratio=<r> target<op><v> pass|FAIL`, the form DESIGN.md fixes."""
    verdict = "pass" if OPS[op](ratio, target) else "FAIL"
    return f"RESULT {name} ratio={ratio:.3g} target{op}{target:g} {verdict}"


def agreement(ratio: float) -> float:
    """1 - |ratio - 1|: 1.0 when two measurements agree, 0.9 when they are 10% apart either way: a two-sided
    "within X%" held as one fixed target (`agreement >= 1 - X`), the raw ratio printed beside it."""
    return 1.0 - abs(ratio - 1.0)


def build_loader(config, backend: str, **settings):
    """A loader of `backend` for the config's train split, settings given as keywords."""
    from loadopt.config import expand_settings
    from loadopt.device import resolve_device
    from loadopt.loaders.registry import backend_class
    from loadopt.storage.open import open_dataset

    cls = backend_class(backend)
    dataset = open_dataset(config)
    point = expand_settings(cls.Settings, settings, f"loaders.{backend}", "bench")[0]
    return cls(dataset, config.pipeline, point, device=resolve_device(config.workload.device), seed=config.seed)


def harness_run(loader, batches: int, warmup: int = 3, step_ms: float = 0.0, epoch: int | None = None,
                emulate: bool = True):
    """One run of the harness over `loader` (prepared first, closed after): its `RepeatResult`.
    `emulate`: the CPU stand-in for the device copy (off: the real device's copy, e.g. on CUDA)."""
    from loadopt.bench.accelerator import EmulatedAccelerator
    from loadopt.bench.harness import run_repeat
    from loadopt.device import DeviceTransfer

    if epoch is not None:
        loader.set_epoch(epoch)
    try:
        loader.prepare()  # conversions happen here, never in the measured window
        return run_repeat(loader, EmulatedAccelerator(step_ms / 1000.0, loader.device),
                          DeviceTransfer(loader.device, emulate=emulate), warmup_batches=warmup,
                          measure_batches=batches)
    finally:
        loader.close()


def host_batches_forever(loader):
    """The loader's host batches, epoch after epoch (a new epoch starts where the last one ended)."""
    while True:
        produced = False
        for batch in loader.host_batches():
            produced = True
            yield batch
        if not produced:
            raise RuntimeError(f"loader {loader.name} produced no batches")


def spread(values: list[float], spec: str = ".3g") -> str:
    """`median m, spread lo-hi over n rounds` of a figure measured once per round."""
    import statistics

    return (f"median {format(statistics.median(values), spec)}, spread {format(min(values), spec)}-"
            f"{format(max(values), spec)} over {len(values)} rounds")


def ratio_result(name: str, ratios: list[float], op: str, target: float) -> str:
    """Print the spread of a ratio over the rounds; the RESULT line on its median (the figure held)."""
    import statistics

    print(f"{name}: per round " + ", ".join(f"{r:.3g}" for r in ratios) + f"; {spread(ratios)}", flush=True)
    return result_line(name, statistics.median(ratios), op, target)
