"""The bench's metrics, computed from the per-batch probes of one measured window.

Definitions (warm-up batches excluded):
- `samples_per_s`, `mb_per_s`: samples and stored (encoded) sample bytes delivered per wall second;
  `tokens_per_s` (token workloads) = samples_per_s x seq_len.
- `accelerator_utilisation` = sum(compute_i) / wall; `stall_fraction` = 1 - accelerator_utilisation: the
  share of the window the accelerator was idle. The device runs as a GPU does in the harness:
  the copy and finishing of a batch overlap the step before, so they stall it only where they cannot keep up.
- `loader_stall_fraction`, `finish_stall_fraction`: that idle time split by whose it was (summed
  `loader_stall_s`, `finish_stall_s` of the probes over wall): the loader's (the device went idle before
  the batch reached the host) and the host finishing's (the batch was there; its copy and finishing on
  the host, or the host itself, were not done). On the emulated device they add up to `stall_fraction`;
  None where the device's gaps are not seen on the host clock (CUDA: `device_idle_fraction`).
- `wait_*_ms`: percentiles of wait_i, the time from asking for batch i to holding it.
- `h2d_gb_per_s` = bytes moved / sum(h2d_i); `h2d_pinned` says whether the source was pinned.
- `storage_bytes_read` (/proc io read_bytes of the process tree), `bytes_read` (the loader's own
  count), `goodput_ratio` = bytes of samples delivered / bytes_read (above 1 where the stored form is
  smaller than the sources: the encoded forms' JPEGs, re-entropy-coded with optimised tables).
- `cpu_seconds_per_1k_samples` over the process tree, `peak_rss_mb` of the tree (shared pages
  counted in every process that maps them) and `peak_pss_mb` (shared pages counted once).
- `others_cpu_share`: of all the machine's cores over the window, the share other processes used.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from loadopt.bench.monitor import TreeUsage
from loadopt.device import Elapsed
from loadopt.schema.metrics import Figure, RepeatMetrics, RunMetrics, Spread

# Metrics that describe the run rather than vary with it are not aggregated over repeats.
NOT_AGGREGATED = ("h2d_pinned", "h2d_emulated")


@dataclass
class BatchProbe:
    """What the harness saw of one batch."""

    index: int
    measured: bool
    start_s: float  # when the batch was asked for, from the run's start
    wait_s: float
    h2d: Elapsed
    h2d_bytes: int
    finish_s: float  # host time of the copy and the on-device finishing (layout, normalisation)
    compute: Elapsed
    samples: int
    sample_bytes: int  # stored (encoded) bytes of the batch's samples
    # The accelerator's idle time before this step, the loader's and the host finishing's (see the module);
    # None where it is not known on the host clock (CUDA).
    loader_stall_s: float | None = None
    finish_stall_s: float | None = None
    ended_s: float | None = None  # when the step ended, from the run's start (None: on the device's clock)


def percentile_ms(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q) * 1000.0) if len(values) else 0.0


def step_metrics(*, waits_s: np.ndarray, wall_s: float, compute_s: float, samples: int, batches: int,
                 sample_bytes: float | None, h2d_s: float, h2d_bytes: int, cpu_seconds: float | None,
                 storage_bytes_read: int, peak_rss_bytes: int | None, peak_pss_bytes: int | None,
                 utilisation: float | None = None) -> RepeatMetrics:
    """The step metrics from one measured window's totals: the one place they are computed,
    for `loadopt bench` (`window_metrics`) and `loadopt measure` (loadopt.measure.reporting).

    `utilisation` defaults to compute_s / wall_s; a caller that timed the device itself (CUDA events)
    passes its own. `sample_bytes` None: the stored bytes are unknown (no `mb_per_s`)."""
    if utilisation is None:
        utilisation = compute_s / wall_s if wall_s > 0 else 0.0
    utilisation = min(1.0, utilisation)
    return {
        "samples": samples,
        "batches": batches,
        "wall_s": wall_s,
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        "mb_per_s": (sample_bytes / wall_s / 1e6 if wall_s > 0 else 0.0) if sample_bytes is not None else None,
        "accelerator_utilisation": utilisation,
        "stall_fraction": 1.0 - utilisation,
        "compute_s": compute_s,
        "wait_s": float(waits_s.sum()),
        "wait_p50_ms": percentile_ms(waits_s, 50),
        "wait_p95_ms": percentile_ms(waits_s, 95),
        "wait_p99_ms": percentile_ms(waits_s, 99),
        "wait_max_ms": float(waits_s.max() * 1000.0) if len(waits_s) else 0.0,
        "h2d_s": h2d_s,
        "h2d_gb_per_s": h2d_bytes / h2d_s / 1e9 if h2d_s > 0 else None,
        "storage_bytes_read": storage_bytes_read,
        "cpu_seconds": cpu_seconds,
        "cpu_seconds_per_1k_samples": cpu_seconds / samples * 1000.0 if cpu_seconds is not None and samples else None,
        "peak_rss_mb": peak_rss_bytes / 2**20 if peak_rss_bytes is not None else None,
        "peak_pss_mb": peak_pss_bytes / 2**20 if peak_pss_bytes is not None else None,
    }


def window_metrics(probes: list[BatchProbe], wall_s: float, usage: TreeUsage, loader_bytes_read: int,
                   h2d_pinned: bool, h2d_emulated: bool, device_idle_s: float | None = None,
                   tokens_per_sample: int | None = None) -> RepeatMetrics:
    """The metrics of one repeat of `loadopt bench` from the probes of its measured batches."""
    measured = [p for p in probes if p.measured]
    sample_bytes = sum(p.sample_bytes for p in measured)
    metrics = step_metrics(
        waits_s=np.array([p.wait_s for p in measured]), wall_s=wall_s,
        compute_s=sum(p.compute.seconds() for p in measured), samples=sum(p.samples for p in measured),
        batches=len(measured), sample_bytes=sample_bytes, h2d_s=sum(p.h2d.seconds() for p in measured),
        h2d_bytes=sum(p.h2d_bytes for p in measured), cpu_seconds=usage.cpu_seconds,
        storage_bytes_read=usage.storage_bytes_read, peak_rss_bytes=usage.peak_rss_bytes,
        peak_pss_bytes=usage.peak_pss_bytes)
    samples_per_s = median(metrics, "samples_per_s")
    split = bool(measured) and all(p.loader_stall_s is not None and p.finish_stall_s is not None for p in measured)
    metrics.update({
        "loader_stall_fraction": _share(sum(p.loader_stall_s or 0.0 for p in measured), wall_s) if split else None,
        "finish_stall_fraction": _share(sum(p.finish_stall_s or 0.0 for p in measured), wall_s) if split else None,
        "finish_s": sum(p.finish_s for p in measured),
        "h2d_pinned": h2d_pinned,
        "h2d_emulated": h2d_emulated,
        "sample_bytes_delivered": sample_bytes,
        "bytes_read": loader_bytes_read,
        "goodput_ratio": sample_bytes / loader_bytes_read if loader_bytes_read > 0 else None,
        # The share of all cores other processes used meanwhile: above ~0.25 the rate is the busy machine's.
        "others_cpu_share": usage.others_cpu_share,
    })
    if tokens_per_sample is not None:
        metrics["tokens_per_s"] = (samples_per_s or 0.0) * tokens_per_sample
    if device_idle_s is not None:
        metrics["device_idle_fraction"] = min(1.0, device_idle_s / wall_s) if wall_s > 0 else None
    return metrics


def _share(seconds: float, wall_s: float) -> float:
    return min(1.0, seconds / wall_s) if wall_s > 0 else 0.0


def aggregate(repeats: list[RepeatMetrics]) -> RunMetrics:
    """Median and min-max spread of every numeric metric over the repeats."""
    out: RunMetrics = {}
    for key in repeats[0]:
        values = [v for r in repeats if (v := r.get(key)) is not None]
        numbers = [v for v in values if isinstance(v, (int, float))]
        if key in NOT_AGGREGATED or not values or len(numbers) < len(values):
            out[key] = repeats[0][key]
            continue
        out[key] = Spread(median=statistics.median(numbers), min=min(numbers), max=max(numbers))
    return out


def median(metrics: Mapping[str, Spread | Figure], key: str) -> float | None:
    """The median of an aggregated metric (None when it was not measured), or a repeat's own value."""
    value = metrics.get(key)
    if isinstance(value, dict):
        return value["median"]
    return value if isinstance(value, (int, float)) else None  # a note or a missing figure has no median
