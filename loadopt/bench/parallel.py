"""Rates measured the way the loaders run: several worker processes at once, one intra-op thread each.

A ceiling measured in the consumer process with torch's default intra-op threads is not what a
loader does (its workers run one thread each), and on a busy machine it is far from it: the threads
of one torch op wait for each other behind the other processes' time slices (measured: simplejpeg +
torch's resize at 48 img/s in-process against 508 img/s with one thread, two busy loops running).
Worker processes, as many as the busiest loader setting runs, also get the share of the CPU that the
loader's own processes get from the scheduler, so a ceiling and the runs held to it see the same
machine.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

WorkItem = Callable[[int], None]  # does the i-th unit of work (decodes the i-th sample, ...)


def _worker(work: WorkItem, start_at: float, seconds: float, results) -> None:
    import torch

    torch.set_num_threads(1)  # one intra-op thread, as DataLoader workers and loader threads run
    work(0)  # warm-up: first-call costs (imports, allocator) are not the rate
    while time.perf_counter() < start_at:
        time.sleep(0.001)
    done = 0
    while True:
        work(done)
        done += 1
        if time.perf_counter() - start_at >= seconds:
            break
    results.put((done, time.perf_counter() - start_at))


def rate_in_workers(work: WorkItem, workers: int, seconds: float = 1.0) -> dict[str, Any]:
    """Units of `work` per second done by `workers` forked processes running together for `seconds`.

    Each process starts at the same instant (after its own warm-up) and stops after the unit that
    crosses `seconds`; the rate is the units done by all over the longest of their windows."""
    context = multiprocessing.get_context("fork")  # the work (its samples in memory) is inherited, not pickled
    results = context.SimpleQueue()
    start_at = time.perf_counter() + 0.5 + 0.1 * workers  # time to fork and warm up before the clock starts
    processes = [context.Process(target=_worker, args=(work, start_at, seconds, results), daemon=True)
                 for _ in range(workers)]
    for process in processes:
        process.start()
    outcomes = []
    try:
        deadline = time.monotonic() + 60.0 + 4 * seconds
        while len(outcomes) < workers:
            if time.monotonic() > deadline or not any(p.is_alive() for p in processes) and results.empty():
                raise RuntimeError(f"{workers - len(outcomes)} of {workers} measuring processes gave no rate")
            if results.empty():
                time.sleep(0.01)
                continue
            outcomes.append(results.get())
    finally:
        for process in processes:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
    done = sum(count for count, _ in outcomes)
    window = max(elapsed for _, elapsed in outcomes)
    return {"samples_per_s": done / window, "workers": workers, "samples": done, "seconds": window}


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
