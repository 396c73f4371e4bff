"""When each request arrives: an open-loop Poisson process at a rate (LoadGen's server scenario), or a file of
arrival times. Latency is measured from these scheduled times, never from when a request was picked up
(no coordinated omission)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loadopt.errors import ConfigError


def poisson_arrivals(rate_qps: float, count: int, seed: int) -> np.ndarray:
    """`count` arrival times (seconds from the start) of a Poisson process of `rate_qps` requests per second:
    exponential gaps, the first request one gap after the start."""
    if rate_qps <= 0:
        raise ValueError(f"an arrival rate must be positive, not {rate_qps}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_qps, count)
    return np.cumsum(gaps)


def read_arrivals(path: str | Path) -> np.ndarray:
    """Arrival times from a file (seconds from the start, one per line; blank lines and `#` comments skipped),
    non-decreasing; a bad line is a `ConfigError` naming it."""
    where = Path(path).expanduser()
    try:
        text = where.read_text()
    except OSError as exc:
        raise ConfigError(f"workload.serve.arrivals: cannot read {where} ({exc.strerror or exc})") from None
    times: list[float] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            value = float(line)
        except ValueError:
            raise ConfigError(f"{where}:{number}: expected an arrival time in seconds, not {line!r}") from None
        if not np.isfinite(value) or value < 0 or (times and value < times[-1]):
            raise ConfigError(f"{where}:{number}: arrival times must be finite, >= 0 and non-decreasing "
                              f"({value:g} after {times[-1] if times else 0:g})")
        times.append(value)
    if not times:
        raise ConfigError(f"workload.serve.arrivals: {where} holds no arrival times")
    return np.asarray(times, dtype=np.float64)


def offered_rate(arrivals: np.ndarray) -> float:
    """Requests per second the schedule offers (its count over its span)."""
    span = float(arrivals[-1]) if len(arrivals) else 0.0
    return len(arrivals) / span if span > 0 else float("inf")
