"""`loadopt bench` under `torchrun`: one emulated accelerator per rank, each on its shard of the data.

    torchrun --nproc-per-node N -m loadopt bench CONFIG

Every rank builds each configured loader for its rank of the world (the shared sample order gives
each rank a disjoint share: every sample once per epoch across ranks), runs it through the same
harness as a single-process bench, and after every step joins an all-reduce of one element: the
stand-in for a data-parallel job's gradient all-reduce, so a rank that waits for data holds every
other rank up, as it would in training (gloo on CPU, nccl on GPU). The time a rank spends in that
all-reduce counts neither as its data wait nor as compute, so it lowers that rank's utilisation.

Rank 0 generates the dataset and any format conversion first (the others then find them cached),
gathers every rank's metrics after each run, and writes one results.json: per-rank figures, the
aggregate over ranks and the slowest rank (the one that waited longest for data). The other ranks
write nothing. The per-batch timings file holds rank 0's batches.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from loadopt.bench.harness import RepeatResult, run_repeat
from loadopt.bench.metrics import median
from loadopt.config import Config
from loadopt.device import DeviceTransfer, Elapsed, resolve_device

T = TypeVar("T")

# Summed over ranks (extensive), the worst over ranks, or the mean over ranks; the rates are recomputed.
_SUMMED = ("samples", "compute_s", "wait_s", "h2d_s", "finish_s", "sample_bytes_delivered", "bytes_read",
           "storage_bytes_read", "cpu_seconds", "peak_rss_mb", "peak_pss_mb")
_WORST = ("wall_s", "batches", "wait_p50_ms", "wait_p95_ms", "wait_p99_ms", "wait_max_ms")
_MEAN = ("accelerator_utilisation", "h2d_gb_per_s", "device_idle_fraction")


def launched() -> bool:
    """Whether this process is one rank of several started by torchrun (its environment says so)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def secondary_rank() -> bool:
    """A rank other than 0 under torchrun: it measures, but rank 0 writes and prints."""
    return launched() and int(os.environ["RANK"]) != 0


class _StepSync:
    """The emulated accelerator's step followed by an all-reduce of one element across ranks."""

    def __init__(self, accelerator, device: torch.device) -> None:
        self.accelerator = accelerator
        self._token = torch.zeros(1, device=device)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> Elapsed:
        elapsed = self.accelerator.step(inputs, labels)
        torch.distributed.all_reduce(self._token)
        return elapsed

    def drain(self) -> None:
        self.accelerator.drain()


class _RecordingLoader:
    """A loader that remembers which samples it delivered in which epoch (for the per-rank record)."""

    def __init__(self, loader) -> None:
        self._loader = loader
        self.delivered: dict[int, list[np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def host_batches(self) -> Iterator[Any]:
        for batch in self._loader.host_batches():
            self.delivered.setdefault(self._loader.epoch, []).append(np.asarray(batch.indices, dtype=np.int64))
            yield batch

    def record(self) -> list[dict[str, Any]]:
        """Per epoch: how many samples, an order-free digest of which, and whether the epoch was complete."""
        out = []
        per_epoch = len(self._loader.order().indices())
        for epoch, batches in sorted(self.delivered.items()):
            indices = np.sort(np.concatenate(batches))
            out.append({"epoch": epoch, "samples": len(indices), "complete": len(indices) == per_epoch,
                        "digest": indices_digest(indices)})
        return out


def indices_digest(indices: np.ndarray) -> str:
    """A digest of a set of sample indices (sorted first, so the order does not matter)."""
    return hashlib.sha256(np.sort(np.asarray(indices, dtype=np.int64)).tobytes()).hexdigest()[:16]


def aggregate_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures from its ranks': totals, the worst wait percentiles, the mean utilisation."""
    first = per_rank[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        values = [m[key] for m in per_rank if m.get(key) is not None]
        if key in _SUMMED and values:
            out[key] = sum(values)
        elif key in _WORST and values:
            out[key] = max(values)
        elif key in _MEAN and values:
            out[key] = sum(values) / len(values)
        else:
            out[key] = value
    wall = out["wall_s"]
    out["samples_per_s"] = out["samples"] / wall if wall > 0 else 0.0
    out["mb_per_s"] = out["sample_bytes_delivered"] / wall / 1e6 if wall > 0 else 0.0
    if "tokens_per_s" in first:
        out["tokens_per_s"] = sum(m["tokens_per_s"] for m in per_rank)
    out["stall_fraction"] = 1.0 - out["accelerator_utilisation"]
    out["goodput_ratio"] = out["sample_bytes_delivered"] / out["bytes_read"] if out["bytes_read"] else None
    out["cpu_seconds_per_1k_samples"] = out["cpu_seconds"] / out["samples"] * 1000.0 if out["samples"] else None
    return out


def slowest_rank(per_rank_repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The rank that waited longest for data (median over repeats): the one the others waited for."""
    waits = [float(np.median([r["metrics"]["wait_s"] for r in repeats])) for repeats in per_rank_repeats]
    rank = int(np.argmax(waits))
    rates = [float(np.median([r["metrics"]["samples_per_s"] for r in per_rank_repeats[rank]]))]
    return {"rank": rank, "wait_s": waits[rank], "samples_per_s": rates[0],
            "accelerator_utilisation": float(np.median([r["metrics"]["accelerator_utilisation"]
                                                        for r in per_rank_repeats[rank]]))}


def _rank0_first(rank: int, work: Callable[[], T]) -> T:
    """Rank 0 does `work` first (dataset generation, conversions land in the shared cache), then the others."""
    if rank == 0:
        value = work()
        torch.distributed.barrier()
        return value
    torch.distributed.barrier()
    return work()


def _device_for_rank(requested: str) -> torch.device:
    device = resolve_device(requested)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def run_bench_distributed(config: Config, *, loaders: list[str] | None, out: str | None, quick: bool,
                          reporter, convert: bool):
    """`run_bench` for one rank under torchrun (see the module docstring); rank 0 returns the outcome,
    the other ranks an outcome without results (`json_path` None)."""
    from loadopt.bench.accelerator import make_accelerator
    from loadopt.bench.results import prepare_output, write_results
    from loadopt.bench.runner import (
        BenchOutcome,
        Reporter,
        _evict,
        _plan,
        _results,
        _timing_rows,
        effective_workload,
        setting_loader,
    )
    from loadopt.storage.imagefolder import open_dataset

    dist = torch.distributed
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = _device_for_rank(config.workload.device)
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=dt.timedelta(minutes=10))
    try:
        reporter = reporter if rank == 0 and reporter is not None else Reporter()
        folder = prepare_output(out or config.report.out) if rank == 0 else None
        workload = effective_workload(config.workload, quick)
        dataset = _rank0_first(rank, lambda: open_dataset(config, progress=reporter.dataset_progress))
        plan = _rank0_first(rank, lambda: _plan(config, loaders or list(config.loaders), dataset, device, reporter,
                                                convert if rank == 0 else False))
        accelerator = _StepSync(make_accelerator(workload.model, workload.step_time_ms, len(dataset.classes), device),
                                device)
        per_rank: dict[str, list[list[dict[str, Any]]]] = {}
        cache_note = "warm: the page cache was left as it was"
        for repeat in range(workload.repeats):
            for setting in plan:
                if setting.status != "ok":
                    continue
                reporter.run_started(f"{setting.label} (repeat {repeat + 1}/{workload.repeats}, rank 0 of {world})",
                                     workload.warmup_batches + workload.measure_batches)
                loader = setting_loader(config, setting, dataset, device, rank, world)
                try:
                    if config.storage.cache == "cold":
                        cache_note = _evict(loader.storage_files())
                    recording = _RecordingLoader(loader)
                    dist.barrier()  # every rank starts its run together
                    result = run_repeat(recording, accelerator, DeviceTransfer(device, emulate=True),
                                        workload.warmup_batches, workload.measure_batches,
                                        on_batch=reporter.batch_done)
                finally:
                    loader.close()
                mine = {"rank": rank, "host": os.uname().nodename, "device": str(device), "metrics": result.metrics,
                        "delivered": recording.record()}
                gathered: list[Any] | None = [None] * world if rank == 0 else None
                dist.gather_object(mine, gathered, dst=0)
                if rank != 0:
                    continue
                ranks = per_rank.setdefault(setting.label, [[] for _ in range(world)])
                for entry in gathered:
                    ranks[entry["rank"]].append(entry)
                job = aggregate_ranks([entry["metrics"] for entry in gathered])
                setting.repeats.append(RepeatResult(job, result.probes, result.skipped))
                reporter.run_finished(setting.label, job, None)
        if rank != 0:
            return BenchOutcome({"rank": rank}, None, None, False)
        results = _results(config, plan, dataset, device, workload, quick, False, cache_note)
        _add_ranks(results, per_rank, world, dist.get_backend())
        json_path, parquet_path = write_results(folder, results, _timing_rows(plan))
        return BenchOutcome(results, json_path, parquet_path, False)
    finally:
        if started_here:
            dist.destroy_process_group()


def _add_ranks(results: dict[str, Any], per_rank: dict[str, list[list[dict[str, Any]]]], world: int,
               backend: str) -> None:
    results["command"] = f"torchrun --nproc-per-node {world} -m loadopt bench"
    results["distributed"] = {
        "world_size": world, "backend": backend,
        "step_sync": "an all-reduce of one element after every step (stand-in for the gradient all-reduce)",
        "aggregate": "samples/s and MB/s: all ranks' samples over the longest rank's window; utilisation: the "
                     "mean over ranks; wait percentiles: the worst rank's; CPU, memory, bytes: summed",
        "timings": "timings.parquet holds rank 0's batches",
    }
    slowest_text = []
    for run in results["runs"]:
        ranks = per_rank.get(run["label"])
        if not ranks:
            continue
        run["ranks"] = [{"rank": r, "host": repeats[0]["host"], "device": repeats[0]["device"],
                         "metrics": [x["metrics"] for x in repeats], "delivered": [x["delivered"] for x in repeats]}
                        for r, repeats in enumerate(ranks)]
        run["slowest_rank"] = slowest_rank(ranks)
        slow = run["slowest_rank"]
        slowest_text.append(f"{run['label']}: rank {slow['rank']} (waited {slow['wait_s']:.2f} s for data, "
                            f"AU {slow['accelerator_utilisation']:.0%})")
    if results["ranking"]:
        best = next(r for r in results["runs"] if r["label"] == results["ranking"][0])
        rate = median(best["metrics"], "samples_per_s")
        results["summary"] = (f"fastest on {world} ranks: {best['label']} at {rate:,.0f} samples/s in all; "
                              f"slowest rank {best['slowest_rank']['rank']}")
    results["distributed"]["slowest_ranks"] = slowest_text
