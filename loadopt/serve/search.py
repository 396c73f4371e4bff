"""The highest arrival rate whose p99 latency stays within a bound (LoadGen's server mode, perf_analyzer's
`--latency-threshold`): the first run at the configured rate, then the rate doubled (or halved) until the bound
is crossed, then halved intervals between the highest rate within it and the lowest beyond it."""

from __future__ import annotations

from collections.abc import Callable

from loadopt.schema.serve import ServerPoint

Trial = Callable[[float], ServerPoint]  # one open-loop run at a rate


def highest_rate_within(trial: Trial, first_qps: float, slo_ms: float, runs: int,
                        curve: list[ServerPoint]) -> ServerPoint | None:
    """The best point within `slo_ms` found in `runs` runs of `trial` (each appended to `curve`), or None when
    even the lowest rate tried was beyond it."""
    within: ServerPoint | None = None
    beyond: ServerPoint | None = None
    rate = first_qps
    for _ in range(runs):
        point = trial(rate)
        curve.append(point)
        # Beyond the bound also when the server fell behind the arrivals: its p99 grows with the run's length.
        if point.p99_ms <= slo_ms and point.achieved_qps >= 0.9 * point.scheduled_qps:
            if within is None or point.offered_qps > within.offered_qps:
                within = point
        elif beyond is None or point.offered_qps < beyond.offered_qps:
            beyond = point
        if beyond is None:
            rate = rate * 2
        elif within is None:
            rate = rate / 2
        else:
            if beyond.offered_qps / within.offered_qps < 1.02:  # as close as a run's noise tells apart
                break
            rate = (within.offered_qps + beyond.offered_qps) / 2
    curve.sort(key=lambda p: p.offered_qps)
    return within
