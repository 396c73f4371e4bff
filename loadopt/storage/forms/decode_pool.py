"""The conversions' decode pools: forked workers, stopped without waiting on them forever."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
import threading
from multiprocessing.pool import Pool

log = logging.getLogger(__name__)


_RAY_USED: list[bool] = []  # Ray started or joined by this process: its native threads outlive ray.shutdown()


def start(workers: int) -> Pool | None:
    """A pool of `workers` forked processes (they inherit the dataset set up for them), or None for one, or where
    forking is not safe (`fork_safe`: the work is then done in this process).

    SIGTERM is blocked while the workers are forked (they inherit the mask; `_quiet_worker` unblocks it): a worker
    not yet scheduled when `stop` terminates the pool (a short conversion on a busy machine) would take the
    SIGTERM on its first return from fork, into the Python handler it inherited (the CLI's), before Python's
    after-fork step clears pending signals: lost, and the worker then waited on the task queue's lock for good,
    `stop` on it for its whole timeout. Blocked, the signal stays pending until the worker can die of it."""
    if workers <= 1 or not fork_safe():
        return None
    main = threading.current_thread() is threading.main_thread()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if main else None
    try:
        return multiprocessing.get_context("fork").Pool(workers, initializer=_quiet_worker)
    finally:
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def ray_used() -> None:
    """Mark this process as one that started or joined Ray: it forks no pool from then on."""
    _RAY_USED.append(True)


def fork_safe() -> bool:
    """Whether this process may fork workers: not while connected to Ray, nor after (a fork copies the locks of
    Ray's native threads, which ray.shutdown() leaves running, in whatever state they are: forked workers died or
    hung, and multiprocessing's pool then waited on them forever)."""
    ray = sys.modules.get("ray")
    return ray is None or not (_RAY_USED or ray.is_initialized())


def _quiet_worker() -> None:
    """A decode worker reports a sample's failure through its result (`integrity.guarded`); what it would print
    itself is multiprocessing's noise when the conversion is stopped (Ctrl-C reaches the whole process group,
    SIGTERM the parent, which then stops the pool): a traceback a worker (a KeyboardInterrupt, or a broken pipe
    to the parent that stopped reading). The parent says what stopped the conversion, in one line."""
    import os

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler is the parent's: a worker just ends
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one sent while it forked ends it now
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the worker's for its life


def stop(pool: Pool | None, timeout_s: float = 30.0) -> None:
    """`pool.terminate()`, bounded. CPython's terminate waits on the result queue's lock, and a conversion
    stopped mid-stream (ENOSPC, a damaged file, Ctrl-C) once hung there for good in CI; past the timeout
    the pool is left to the interpreter's exit (its workers are daemonic) and a warning says so."""
    if pool is None:
        return
    stopper = threading.Thread(target=pool.terminate, name="loadopt-pool-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        log.warning("a conversion's decode workers did not stop within %.0f s; they end with this process",
                    timeout_s)


def finish(pool: Pool | None, timeout_s: float = 30.0) -> None:
    """Close `pool` after its work is done: its workers exit on their own (no signal, none of terminate's locks);
    `stop` if they have not within `timeout_s`."""
    if pool is None:
        return
    pool.close()
    joiner = threading.Thread(target=pool.join, name="loadopt-pool-join", daemon=True)
    joiner.start()
    joiner.join(timeout_s)
    if joiner.is_alive():
        stop(pool, timeout_s)
