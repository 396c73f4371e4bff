"""The consumers of `loadopt tiers`: N emulated accelerators reading one tier at once, as DLIO and
MLPerf Storage run them. Each consumer is a storage reader (`readers` threads fetch the stored bytes of
the next `prefetch` batches through the tier, no decode) on its own shard of the shared sample order,
and the emulated accelerator takes `step_time` per batch. All start together and are measured over the
same window after a warm-up; `run_tiers` searches N with them.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import resource
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import final

import numpy as np
from typing_extensions import TypedDict

from loadopt.clock import sleep_until
from loadopt.errors import DatasetError
from loadopt.loaders.sampler import DEFAULT_WINDOW_SHARDS, EpochOrder, ShardWindows, Shuffle
from loadopt.machine import usable_cores
from loadopt.storage.dataset import Dataset
from loadopt.storage.sources.shards import DEFAULT_SHARD_SAMPLES, shard_table


@dataclass(frozen=True)
class ConsumerSettings:
    """What each emulated accelerator's consumer does."""

    batch_size: int
    step_s: float
    readers: int = 4  # threads reading samples through the tier
    prefetch: int = 2  # batches read ahead of the one being consumed
    seed: int = 0
    shuffle: Shuffle = "global"  # pipeline.shuffle, with its window settings below
    drop_last: bool = False
    window_shards: int = DEFAULT_WINDOW_SHARDS
    shard_samples: int = DEFAULT_SHARD_SAMPLES


@final  # (so that `"error" in r` tells a failure from figures, for mypy too)
class ConsumerFigures(TypedDict):
    """One consumer's figures over the window (`consume`); plain data, as it crosses to the parent process or
    to rank 0 (a queue, a gather), where a consumer that failed sends a `ConsumerFailure` instead."""

    rank: int
    accelerator_utilisation: float
    samples_per_s: float
    mb_per_s: float
    batches: int
    wait_p99_ms: float
    failed_reads: int
    cpu_s: float


@final
class ConsumerFailure(TypedDict):
    """A consumer that raised: its rank and the error, in one line."""

    rank: int
    error: str


@dataclass(frozen=True)
class TrialFigures:
    """One trial's figures (`combine`): `accelerators` consumers at once, their mean AU, their sums."""

    accelerators: int
    accelerator_utilisation: float  # the mean over the consumers: the search's criterion
    min_accelerator_utilisation: float
    samples_per_s: float
    mb_per_s: float
    failed_reads: int
    cpu_load: float  # the consumers' CPU over what the machines' cores offered in the same time
    per_consumer: list[ConsumerFigures]


# Plays one trial: (the dataset through a fresh tier, the settings, count, warm-up s, measured s) -> its figures;
# `run_consumers` forks them, `RankConsumers` plays them on a torchrun job's ranks.
PlayTrial = Callable[[Dataset, ConsumerSettings, int, float, float], TrialFigures]


def _batches(dataset: Dataset, settings: ConsumerSettings, rank: int, world: int):
    epoch, num_samples = 0, len(dataset)
    windows = ShardWindows(shard_table(dataset, settings.shard_samples), settings.window_shards) \
        if settings.shuffle == "window" else None
    while True:
        order = EpochOrder(num_samples, settings.batch_size, settings.seed, epoch, rank, world, settings.shuffle,
                           settings.drop_last, windows)
        batches = order.batches()
        if not batches:
            raise DatasetError(f"rank {rank} of {world} has no batches: the dataset has only {num_samples} samples")
        yield from batches
        epoch += 1


def _overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def consume(dataset, settings: ConsumerSettings, rank: int, world: int, t_start: float, t_window: float,
            t_end: float) -> ConsumerFigures:
    """Play one accelerator from `t_start` to `t_end`; its figures over the window [t_window, t_end]."""
    failures = [0]

    def read(index: int) -> int:
        try:
            if dataset.kind == "records":  # the record's byte range, or its whole npz file (as DLIO's reader)
                return dataset.read_record(index)[1]
            return len(dataset.fs.cat_file(dataset.path(index)))
        except (OSError, TimeoutError, DatasetError):  # a read the tier failed for good (after retries): lost
            failures[0] += 1
            return 0

    batches = _batches(dataset, settings, rank, world)
    steps: list[tuple[float, float, float, int, int]] = []  # (asked, got, done, samples, bytes)
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    with ThreadPoolExecutor(settings.readers) as pool:
        sleep_until(t_start)
        pending: deque[list] = deque()
        for _ in range(settings.prefetch + 1):
            pending.append([pool.submit(read, int(i)) for i in next(batches)])
        while True:
            asked = time.perf_counter()
            if asked >= t_end:
                break
            futures = pending.popleft()
            nbytes = sum(f.result() for f in futures)
            got = time.perf_counter()
            pending.append([pool.submit(read, int(i)) for i in next(batches)])
            time.sleep(settings.step_s)
            steps.append((asked, got, time.perf_counter(), len(futures), nbytes))
        for futures in pending:
            for future in futures:
                future.cancel()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    window = t_end - t_window
    compute = sum(_overlap(got, done, t_window, t_end) for _, got, done, _, _ in steps)
    inside = [s for s in steps if t_window <= s[1] < t_end]
    waits = np.array([got - asked for asked, got, _, _, _ in inside]) if inside else np.zeros(1)
    return ConsumerFigures(
        rank=rank, accelerator_utilisation=min(1.0, compute / window),
        samples_per_s=sum(s[3] for s in inside) / window, mb_per_s=sum(s[4] for s in inside) / window / 1e6,
        batches=len(inside), wait_p99_ms=float(np.percentile(waits, 99) * 1000.0), failed_reads=failures[0],
        cpu_s=(cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime))


def _consumer_main(queue, dataset, settings, rank, world, t_start, t_window, t_end) -> None:
    try:
        queue.put(consume(dataset, settings, rank, world, t_start, t_window, t_end))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
        queue.put(ConsumerFailure(rank=rank, error=f"{type(exc).__name__}: {exc}".splitlines()[0]))


def start_delay_s(count: int) -> float:
    """How long after its call a trial of `count` forked consumers starts: every process has started by then."""
    return 0.2 + 0.02 * count


def run_consumers(dataset: Dataset, settings: ConsumerSettings, count: int, warmup_s: float,
                  measure_s: float) -> TrialFigures:
    """`count` consumers at once on `dataset` (whose `fs` is the tier); their figures and the mean AU."""
    context = multiprocessing.get_context("fork")  # the consumers inherit the dataset and the tier instance
    queue = context.Queue()
    t_start = time.perf_counter() + start_delay_s(count)
    t_window = t_start + warmup_s
    t_end = t_window + measure_s
    procs = [context.Process(target=_consumer_main, daemon=True,
                             args=(queue, dataset, settings, rank, count, t_start, t_window, t_end))
             for rank in range(count)]
    for proc in procs:
        proc.start()
    results: list[ConsumerFigures | ConsumerFailure] = []
    try:
        for _ in procs:
            results.append(queue.get(timeout=max(60.0, t_end - time.perf_counter() + 60.0)))
    except queue_module.Empty:
        raise RuntimeError(f"{count} consumers: no answer from {count - len(results)} of them") from None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the trial is dropped, its consumers need not finish it
        for proc in procs:
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return combine(_consumer_figures(results), count, warmup_s, measure_s)


def _consumer_figures(results: list[ConsumerFigures | ConsumerFailure]) -> list[ConsumerFigures]:
    """The consumers' figures; a consumer that failed fails the trial."""
    figures: list[ConsumerFigures] = []
    for result in results:
        if "error" in result:
            raise DatasetError(f"consumer failed: {result['error']}")
        figures.append(result)
    return figures


def combine(results: list[ConsumerFigures], count: int, warmup_s: float, measure_s: float,
            machines: int = 1) -> TrialFigures:
    """One trial's figures from its consumers' (`consume`'s): the mean AU, the sums, the CPU load over the
    cores of the `machines` they ran on."""
    results = sorted(results, key=lambda r: r["rank"])
    cores = usable_cores() * machines
    cpu_s = sum(r["cpu_s"] for r in results)
    return TrialFigures(
        accelerators=count, accelerator_utilisation=float(np.mean([r["accelerator_utilisation"] for r in results])),
        min_accelerator_utilisation=min(r["accelerator_utilisation"] for r in results),
        samples_per_s=sum(r["samples_per_s"] for r in results), mb_per_s=sum(r["mb_per_s"] for r in results),
        failed_reads=sum(r["failed_reads"] for r in results), cpu_load=cpu_s / ((warmup_s + measure_s) * cores),
        per_consumer=results)
