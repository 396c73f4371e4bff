"""A run's request times as the figures serve.json holds: latency percentiles, where the time went, the rate
achieved."""

from __future__ import annotations

import numpy as np

from loadopt.schema.serve import LatencyParts, ServerPoint, SingleStream
from loadopt.serve.arrivals import offered_rate
from loadopt.serve.server import RequestTimes


def _ms(values: np.ndarray, q: float | None = None) -> float:
    if len(values) == 0:
        return float("nan")
    return float((np.mean(values) if q is None else np.percentile(values, q)) * 1e3)


def parts(times: RequestTimes) -> LatencyParts:
    ok = times.served()
    return LatencyParts(queue_ms=_ms((times.started - times.scheduled)[ok]),
                        preprocess_ms=_ms((times.ready - times.started)[ok]),
                        batch_ms=_ms((times.step_start - times.ready)[ok]),
                        compute_ms=_ms((times.done - times.step_start)[ok]))


def server_point(times: RequestTimes, offered_qps: float, slo_ms: float | None) -> ServerPoint:
    """The run's figures; `offered_qps` the rate asked for (its arrivals' own rate is measured here)."""
    ok = times.served()
    latency = (times.done - times.scheduled)[ok]
    wait = (times.started - times.scheduled)[ok]
    span = float(np.nanmax(times.done) - times.scheduled[0]) if ok.any() else float("nan")
    p99 = _ms(latency, 99)
    scheduled_qps = offered_rate(times.scheduled) if len(times.scheduled) > 1 else offered_qps
    achieved_qps = int(ok.sum()) / span if span > 0 else 0.0
    return ServerPoint(offered_qps=offered_qps, scheduled_qps=scheduled_qps, achieved_qps=achieved_qps,
                       requests=len(times.scheduled), errors=len(times.failures),
                       p50_ms=_ms(latency, 50), p90_ms=_ms(latency, 90), p99_ms=p99, p999_ms=_ms(latency, 99.9),
                       mean_ms=_ms(latency), mean_queue_wait_ms=_ms(wait), p99_queue_wait_ms=_ms(wait, 99),
                       mean_batch=float(np.mean(times.batch_sizes)) if times.batch_sizes else 0.0,
                       accelerator_utilisation=times.step_seconds / span if span > 0 else 0.0,
                       parts=parts(times), within_slo=None if slo_ms is None else bool(p99 <= slo_ms))


def single_stream(times: RequestTimes) -> SingleStream:
    ok = times.served()
    latency = (times.done - times.scheduled)[ok]
    return SingleStream(requests=len(times.scheduled), errors=len(times.failures), p50_ms=_ms(latency, 50),
                        p90_ms=_ms(latency, 90), p99_ms=_ms(latency, 99), mean_ms=_ms(latency), parts=parts(times))
