"""serve.json: what `loadopt bench` measures in the inference scenarios (`workload.scenario` offline, server,
single_stream), per request path. Version 1."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

SERVE_SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LatencyParts(_Model):
    """Where a request's time went, mean milliseconds: waiting for a worker (or, for a path that preprocesses
    batches, for its batch), preprocessing, waiting in the batcher for the batch and the accelerator, and the
    batch's transfer and step."""

    queue_ms: float
    preprocess_ms: float
    batch_ms: float
    compute_ms: float


class ServerPoint(_Model):
    """One open-loop run: requests arriving at `offered_qps` (Poisson or a file), each timed from its
    scheduled arrival to its result."""

    offered_qps: float  # the arrival rate asked for
    scheduled_qps: float  # the rate the run's arrivals had (a finite Poisson draw is off the asked rate by a few %)
    achieved_qps: float  # results per second over the run (first arrival to last result)
    requests: int
    errors: int  # requests whose preprocessing failed (damaged bytes); not in the latencies
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    mean_ms: float
    mean_queue_wait_ms: float  # the queue part alone (LatencyParts.queue_ms), what queueing theory calls the wait
    p99_queue_wait_ms: float
    mean_batch: float  # requests per step
    accelerator_utilisation: float  # the steps' time over the run's
    parts: LatencyParts
    within_slo: bool | None = None  # p99 <= slo_ms (None: no bound asked)


class SingleStream(_Model):
    """One request at a time, each issued when the one before has its result (LoadGen's SingleStream)."""

    requests: int
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    parts: LatencyParts


class Offline(_Model):
    """Every sample available at once, in input order, each once (LoadGen's Offline) through a loader."""

    samples: int
    seconds: float
    samples_per_s: float
    first_result_s: float  # from the start to the first batch's result
    accelerator_utilisation: float
    in_order: bool  # every sample once, in input order (checked, not assumed)


class PathResult(_Model):
    """One request path (one row of the table): its runs, or why it has none."""

    label: str
    backend: str
    status: Literal["ok", "unavailable", "error"]
    reason: str = ""
    settings: dict[str, Any] = {}  # the backend's knobs as configured (JSON values)
    offline: Offline | None = None
    server: ServerPoint | None = None  # at target_qps (or the arrivals file)
    best_within_slo: ServerPoint | None = None  # the highest rate whose p99 is within slo_ms
    curve: list[ServerPoint] = []  # every server run, by offered rate (perf_analyzer's curve)
    single_stream: SingleStream | None = None


class ServeResults(_Model):
    schema_version: int = SERVE_SCHEMA_VERSION
    kind: Literal["serve"] = "serve"
    name: str
    scenario: Literal["offline", "server", "single_stream"]
    created: str
    device: str
    dataset: str  # its root and sample count
    recipe: str  # what each path delivers
    arrivals: str  # how requests arrive (server), or ""
    step: str  # the accelerator's step for a batch of n
    batching: str  # the dynamic batcher's settings
    slo_ms: float | None = None
    workers: int
    machine_load: str = ""  # a busy-machine note, once
    interrupted_by: str | None = None  # SIGINT or SIGTERM: the paths finished before it are kept
    paths: list[PathResult]
    summary: str = ""
