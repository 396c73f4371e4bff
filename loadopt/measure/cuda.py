"""Device busy and idle time of a measured loop, read from CUDA events without a per-step sync.

An event is recorded on the training stream when a batch is handed out (the step begins) and when
the loop asks for the next one (the step ends). Because the host runs ahead of the device, the
events of a step complete some time after the host recorded them; reading them at once would
force a synchronisation. So step pairs wait in a small deque and are read back only when they are
at least `lag` steps old and `query()` says they have completed (both calls are non-blocking);
at the end of an iteration the device is synchronised once and the rest is read.

The events tile the stream's timeline: idle = from the end of step i-1 (or the start of the
iteration) to the start of step i, i.e. the device ran dry waiting for the next batch; busy = from
the start to the end of step i. Events are pooled and re-recorded once read, so a long job does
not create two new events per step.
"""

from __future__ import annotations

from collections import deque

import torch


class CudaTimeline:
    """Busy/idle milliseconds of the device's current stream, step by step, read back lazily."""

    def __init__(self, device: torch.device, lag: int = 4) -> None:
        self.device = device
        self.lag = lag
        self.busy_ms = 0.0
        self.idle_ms = 0.0
        self.h2d_ms = 0.0
        self.steps_read = 0
        self._free: list[torch.cuda.Event] = []
        self._steps: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._h2d: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._start: torch.cuda.Event | None = None
        self._prev_end: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None

    def _record(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def window_begins(self) -> None:
        """The loop asks for its first batch: the device's first idle gap is measured from here."""
        # The stream the job trains on, looked up once per iteration, not per step (the lookup is not free).
        self._stream = torch.cuda.current_stream(self.device)
        self._prev_end = self._record()

    def step_begins(self) -> None:
        self._start = self._record()

    def step_ends(self) -> None:
        if self._start is None:
            return
        self._steps.append((self._start, self._record()))
        self._start = None
        self._poll()

    def add_h2d(self, events: tuple[torch.cuda.Event, torch.cuda.Event]) -> None:
        """A copy timed by `DeviceTransfer` (its own events, not pooled), read back like the steps."""
        self._h2d.append(events)

    def _poll(self) -> None:
        # Only pairs at least `lag` steps old: they have normally completed, so the query is true and
        # elapsed_time() does not wait. A pair not yet complete is left for a later step.
        while len(self._steps) > self.lag and self._steps[0][1].query():
            self._read(*self._steps.popleft())
        while len(self._h2d) > self.lag and self._h2d[0][1].query():
            start, end = self._h2d.popleft()
            self.h2d_ms += start.elapsed_time(end)

    def _read(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.busy_ms += start.elapsed_time(end)
        if self._prev_end is not None:
            self.idle_ms += max(0.0, self._prev_end.elapsed_time(start))
            self._free.append(self._prev_end)
        self._free.append(start)
        self._prev_end = end
        self.steps_read += 1

    def drain(self) -> None:
        """End of the iteration: one synchronisation, then every pending pair is read."""
        torch.cuda.synchronize(self.device)
        while self._steps:
            self._read(*self._steps.popleft())
        while self._h2d:
            start, end = self._h2d.popleft()
            self.h2d_ms += start.elapsed_time(end)
        if self._prev_end is not None:
            self._free.append(self._prev_end)
            self._prev_end = None
        self._start = None
