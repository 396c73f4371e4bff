"""Emulated step times per accelerator (`workload.accelerator`), from MLPerf Storage v1.0.

MLPerf Storage emulates each accelerator by sleeping a fixed "computation_time" per batch, measured
by MLCommons on the real accelerator for the real model. The figures below are the closed-division
workload parameters of MLPerf Storage v1.0 (DLIO configs `storage-conf/workload/<model>_<accel>.yaml`
in github.com/mlcommons/storage at v1.0, as submitted, e.g. in mlcommons/storage_results_v1.0,
Closed/HPE/code/storage-conf/workload/):

    resnet50_a100.yaml: computation_time 0.435 s, batch_size 400
    resnet50_h100.yaml: computation_time 0.224 s, batch_size 400
    unet3d_a100.yaml:   computation_time 0.636 s, batch_size 7
    unet3d_h100.yaml:   computation_time 0.323 s, batch_size 7
    cosmoflow_a100.yaml: computation_time 0.00551 s, batch_size 1
    cosmoflow_h100.yaml: computation_time 0.00350 s, batch_size 1
(cosmoflow's as in DLIO's configs/workload/cosmoflow_{a100,h100}.yaml and mlcommons/storage's
storage-conf/workload/cosmoflow_h100.yaml.)

No other accelerator has a published MLPerf Storage figure in v1.0, so no other is listed (we do
not guess one). The step time is per sample times the configured batch size: a step of a batch of
64 on an h100 (resnet50) is 64 / 400 * 224 ms = 35.8 ms.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedStep:
    accelerator: str
    model: str
    batch_size: int
    step_time_s: float
    source: str

    def step_time_ms(self, batch_size: int) -> float:
        """The emulated step time of a batch of `batch_size` samples (the per-sample time scales)."""
        return self.step_time_s * 1000.0 * batch_size / self.batch_size


_SOURCE = "MLPerf Storage v1.0, storage-conf/workload/{}_{}.yaml (computation_time, batch_size)"

STEPS: dict[str, PublishedStep] = {
    f"{accel}-{model}" if model != "resnet50" else accel: PublishedStep(accel, model, batch, seconds,
                                                                        _SOURCE.format(model, accel))
    for accel, model, batch, seconds in (
        ("a100", "resnet50", 400, 0.435),
        ("h100", "resnet50", 400, 0.224),
        ("a100", "unet3d", 7, 0.636),
        ("h100", "unet3d", 7, 0.323),
        ("a100", "cosmoflow", 1, 0.00551),
        ("h100", "cosmoflow", 1, 0.00350),
    )
}
# `a100`/`h100` alone mean the image-classification figure (resnet50), loadopt's default workload.
for _key in list(STEPS):
    if "-" not in _key:
        STEPS[f"{_key}-resnet50"] = STEPS[_key]


def published_step(name: str) -> PublishedStep:
    """The published step of accelerator `name` (`h100`, `a100-unet3d`, ...); ValueError naming the known ones."""
    key = name.strip().lower()
    if key not in STEPS:
        raise ValueError(f"unknown accelerator {name!r} (known: {', '.join(sorted(STEPS))})")
    return STEPS[key]
