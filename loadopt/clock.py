"""Sleeping until a moment, as precisely as a shared machine allows: the one way loadopt waits for a deadline (an
emulated tier's reply, an emulated accelerator's step, a request's arrival, readers started together)."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress

_PR_SET_TIMERSLACK = 29  # prctl option (linux/prctl.h)
_thread_timers = threading.local()


def tighten_timer_slack() -> None:
    """This thread's timer slack at its minimum (1 us), once per thread: Linux's default (50 us) wakes a sleeper late,
    and the emulated latencies and steps are sleeps, so the default added a visible error to a millisecond tier."""
    if not getattr(_thread_timers, "tight", False):
        _thread_timers.tight = True
        if sys.platform.startswith("linux"):
            with suppress(OSError, AttributeError):  # no prctl: the default slack it is
                ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)


def sleep_until(deadline: float, clock: Callable[[], float] = time.perf_counter,
                stop: threading.Event | None = None, spin_s: float = 0.0) -> None:
    """Sleep until `clock()` reads `deadline`. `stop`: wake at once when it is set (a run stopped by Ctrl-C, not at
    a far deadline). `spin_s`: sleep only to that long before the deadline, then yield to other threads until it
    (a plain sleep wakes 0.1-0.3 ms late on a shared machine; a serving worker woken late for an arrival adds that
    to the latency of every request its busy period serves)."""
    left = deadline - clock()
    if left <= 0:
        return
    tighten_timer_slack()
    if left > spin_s:
        if stop is not None:
            if stop.wait(left - spin_s):
                return
        else:
            time.sleep(left - spin_s)
    while spin_s > 0 and clock() < deadline:
        os.sched_yield()  # releases the GIL: the spin never holds up the other threads
