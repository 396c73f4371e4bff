"""Serving requests through one request path: open loop (LoadGen's Server: arrivals on a schedule, a dynamic
batcher as Triton's, one accelerator) and one at a time (SingleStream).

Open loop: `workers` threads take the requests in arrival order, each sleeping until its request's
scheduled arrival if it is early, then preprocess it (`RequestPath.one`) and hand it to the batcher. A request
therefore waits for a free worker exactly as in a queue of `workers` servers; no thread issues requests, so
no dispatcher's delay is added. The batcher (the accelerator's thread) starts a step as soon as the accelerator
is free and a request is waiting, having waited up to `max_queue_delay` after the oldest request was ready for
the batch to fill up to `max_batch`. A path that preprocesses batches (`per_batch`: DALI) gets each batch's
raw requests after the batcher instead. Every request is timed from its scheduled arrival (no coordinated
omission): a late worker makes the latency longer, never the schedule later.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from loadopt.clock import sleep_until
from loadopt.errors import describe_sample_error
from loadopt.loaders.serving import Payload, RequestPath
from loadopt.serve.step import ServingStep

SPIN_S = 0.0005  # `sleep_until` sleeps to this before its deadline, then spins (yielding: costs no busy thread)
Finish = Callable[[torch.Tensor], torch.Tensor]  # a host batch (n, size, size, 3) uint8 -> the model's input


@dataclass(frozen=True)
class Batching:
    max_batch: int
    max_queue_delay_s: float


@dataclass
class RequestTimes:
    """Each request's times (seconds on the host clock from the run's start): its scheduled arrival, when its
    preprocessing started and ended, when its batch's step started and when its result was back. NaN where
    the request failed (`failures`: request -> reason)."""

    scheduled: np.ndarray
    started: np.ndarray
    ready: np.ndarray
    step_start: np.ndarray
    done: np.ndarray
    batch_sizes: list[int] = field(default_factory=list)
    step_seconds: float = 0.0  # the accelerator's busy time (transfer and steps)
    failures: dict[int, str] = field(default_factory=dict)

    @classmethod
    def empty(cls, scheduled: np.ndarray) -> RequestTimes:
        n = len(scheduled)
        return cls(scheduled.astype(np.float64), np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan),
                   np.full(n, np.nan))

    def served(self) -> np.ndarray:
        return ~np.isnan(self.done)


class _Batcher:
    """The queue between the workers and the accelerator. Workers only put (a C queue: a few microseconds, no
    Python-level condition), so the harness adds little to a request's service; the accelerator's thread alone
    takes, counts and holds what it took (`pending`)."""

    _FAILED = object()  # a worker died: its error is raised in the accelerator's thread

    def __init__(self, expected: int) -> None:
        self.queue: queue.SimpleQueue[tuple[int, object, float] | object | None] = queue.SimpleQueue()
        self.remaining = expected  # requests not yet received (or dropped)
        self.pending: deque[tuple[int, object, float]] = deque()
        self.error: BaseException | None = None

    def put(self, request: int, item: object, ready: float) -> None:
        self.queue.put((request, item, ready))

    def drop(self) -> None:
        """A request that will never come (it failed in preprocessing)."""
        self.queue.put(None)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.queue.put(self._FAILED)

    def _receive(self, timeout: float | None) -> bool:
        """One item into `pending` (False when none came within `timeout`; 0: only one already there)."""
        try:
            item = self.queue.get(timeout=timeout) if timeout != 0 else self.queue.get_nowait()
        except queue.Empty:
            return False
        if item is self._FAILED:
            assert self.error is not None
            raise self.error
        self.remaining -= 1
        if item is not None:
            self.pending.append(item)  # type: ignore[arg-type]  # a (request, item, ready) put by `put`
        return True

    def take(self, batching: Batching, clock: Callable[[], float]) -> list[tuple[int, object, float]]:
        """The next batch: waits for a first item, then up to `max_queue_delay` after it was ready for the batch
        to fill; empty when every request has been received and taken."""
        while not self.pending and self.remaining > 0:
            self._receive(0.5)
        if not self.pending:
            return []
        deadline = self.pending[0][2] + batching.max_queue_delay_s
        while len(self.pending) < batching.max_batch and self.remaining > 0:
            if not self._receive(0):  # what is already queued first, then wait for more until the deadline
                left = deadline - clock()
                if left <= 0 or not self._receive(left):
                    break
        count = min(batching.max_batch, len(self.pending))
        return [self.pending.popleft() for _ in range(count)]


def serve_open_loop(path: RequestPath, payloads: Sequence[Payload], scheduled: np.ndarray, batching: Batching,
                    step: ServingStep, finish: Finish, workers: int, stop: threading.Event | None = None,
                    lead_s: float = 0.05) -> RequestTimes:
    """Serve `payloads[i]` arriving at `scheduled[i]` seconds (non-decreasing) after a start `lead_s` from now."""
    n = len(scheduled)
    times = RequestTimes.empty(scheduled)
    batcher = _Batcher(n)
    stop = stop or threading.Event()
    claim = iter(range(n))
    claim_lock = threading.Lock()
    start = time.perf_counter() + lead_s

    def clock() -> float:
        return time.perf_counter() - start

    def next_request() -> int | None:
        with claim_lock:
            return next(claim, None)

    def work() -> None:
        try:
            while not stop.is_set():
                request = next_request()
                if request is None:
                    return
                if scheduled[request] > clock():
                    sleep_until(start + scheduled[request], stop=stop, spin_s=SPIN_S)
                    if stop.is_set():
                        return
                began = clock()
                times.started[request] = began
                if path.per_batch:  # preprocessed with its batch, after the batcher
                    batcher.put(request, payloads[request], began)
                    continue
                try:
                    image = path.one(payloads[request])
                except Exception as exc:  # noqa: BLE001 - a damaged request is counted, the server goes on
                    times.failures[request] = describe_sample_error(exc)
                    batcher.drop()
                    continue
                ended = clock()
                times.ready[request] = ended
                batcher.put(request, image, ended)
        except BaseException as exc:
            batcher.fail(exc)
            raise

    threads = [threading.Thread(target=work, name=f"loadopt-serve-{k}", daemon=True)
               for k in range(1 if path.per_batch else workers)]
    for thread in threads:
        thread.start()
    try:
        _accelerate(path, batcher, batching, step, finish, times, clock, stop)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return times


def _accelerate(path: RequestPath, batcher: _Batcher, batching: Batching, step: ServingStep, finish: Finish,
                times: RequestTimes, clock: Callable[[], float], stop: threading.Event) -> None:
    """The accelerator's thread: batches taken as they come, each stepped, until every request is answered."""
    while not stop.is_set():
        taken = batcher.take(batching, clock)
        if not taken:
            return
        requests = np.array([request for request, _, _ in taken], dtype=np.int64)
        if path.per_batch:
            began = clock()
            times.started[requests] = began
            try:
                images = path.batch([item for _, item, _ in taken])
            except Exception as exc:  # noqa: BLE001 - the batch's requests fail together, the server goes on
                for request in requests.tolist():
                    times.failures[request] = describe_sample_error(exc)
                continue
            times.ready[requests] = clock()
        else:
            images = torch.stack([item for _, item, _ in taken])  # type: ignore[misc]  # workers put tensors
        began = clock()
        times.step_start[requests] = began
        step.run(finish(images))
        ended = clock()
        times.done[requests] = ended
        times.step_seconds += ended - began
        times.batch_sizes.append(len(requests))


def serve_one_at_a_time(path: RequestPath, payloads: Sequence[Payload], step: ServingStep,
                        finish: Finish) -> RequestTimes:
    """SingleStream: each request issued when the one before has its result; its latency from its issue."""
    n = len(payloads)
    times = RequestTimes.empty(np.zeros(n))
    start = time.perf_counter()
    for request, payload in enumerate(payloads):
        issued = time.perf_counter() - start
        times.scheduled[request] = times.started[request] = issued
        try:
            images = path.batch([payload]) if path.per_batch else path.one(payload).unsqueeze(0)
        except Exception as exc:  # noqa: BLE001 - counted, the stream goes on
            times.failures[request] = describe_sample_error(exc)
            continue
        times.ready[request] = times.step_start[request] = time.perf_counter() - start
        step.run(finish(images))
        times.done[request] = time.perf_counter() - start
        times.step_seconds += times.done[request] - times.step_start[request]
        times.batch_sizes.append(1)
    return times
