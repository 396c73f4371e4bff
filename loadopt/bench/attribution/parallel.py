"""Rates measured the way the loaders run: several worker processes at once, one intra-op thread each.

A ceiling measured in the consumer process with torch's default intra-op threads is not what a
loader does (its workers run one thread each), and on a busy machine it is far from it: the threads
of one torch op wait for each other behind the other processes' time slices (with two busy loops
running, simplejpeg + torch's resize ran an order of magnitude slower in-process than on one thread).
Worker processes, as many as the busiest loader setting runs, also get the share of the CPU that the
loader's own processes get from the scheduler, so a ceiling and the runs held to it see the same
machine.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

from typing_extensions import TypedDict

WorkItem = Callable[[int], None]  # does the i-th unit of work (decodes the i-th sample, ...)


class WorkerRate(TypedDict):
    """What `rate_in_workers` measured: units a second, by how many processes, how many units in what time."""

    samples_per_s: float
    workers: int
    samples: int
    seconds: float


def _worker(work: WorkItem, ready, go, seconds: float, results) -> None:
    import torch

    torch.set_num_threads(1)  # one intra-op thread, as DataLoader workers and loader threads run
    work(0)  # warm-up: first-call costs (imports, allocator) are not the rate
    ready.put(True)
    go.wait()
    start, done = time.perf_counter(), 0
    while True:
        work(done)
        done += 1
        if time.perf_counter() - start >= seconds:
            break
    results.put((done, time.perf_counter() - start))


def _collect(queue, count: int, processes: list, deadline: float, what: str) -> list:
    got: list = []
    while len(got) < count:
        if not queue.empty():
            got.append(queue.get())
        elif time.monotonic() > deadline or not any(p.is_alive() for p in processes):
            raise RuntimeError(f"{count - len(got)} of {count} measuring processes gave no {what}")
        else:
            time.sleep(0.01)
    return got


def rate_in_workers(work: WorkItem, workers: int, seconds: float = 1.0) -> WorkerRate:
    """Units of `work` per second done by `workers` forked processes running together for `seconds`.

    The processes start together once all have warmed up (however long forking takes on a busy machine)
    and each stops after the unit that crosses `seconds`; the rate is the units done by all over the
    longest of their windows."""
    context = multiprocessing.get_context("fork")  # the work (its samples in memory) is inherited, not pickled
    ready, results, go = context.SimpleQueue(), context.SimpleQueue(), context.Event()
    processes = [context.Process(target=_worker, args=(work, ready, go, seconds, results), daemon=True)
                 for _ in range(workers)]
    for process in processes:
        process.start()
    try:
        _collect(ready, workers, processes, time.monotonic() + 120.0, "start")
        go.set()
        outcomes = _collect(results, workers, processes, time.monotonic() + 60.0 + 10 * seconds, "rate")
    finally:
        for process in processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
    done = sum(count for count, _ in outcomes)
    window = max(elapsed for _, elapsed in outcomes)
    return WorkerRate(samples_per_s=done / window, workers=workers, samples=done, seconds=window)


def in_process_rate(work: WorkItem, seconds: float = 1.0) -> float:
    """Units of `work` per second in this process with one intra-op thread (where fork is unavailable)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work(0)
        done, start = 0, time.perf_counter()
        while True:
            work(done)
            done += 1
            if time.perf_counter() - start >= seconds:
                break
        return done / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
