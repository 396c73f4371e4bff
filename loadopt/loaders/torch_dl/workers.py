"""What became of the worker processes of a torch `DataLoader`: which one died and how, in words, whether
the death is met inside `next()` or announced by torch's SIGCHLD handler between batches."""

from __future__ import annotations

import re
import signal
import threading
import weakref
from typing import Any

from loadopt.errors import WorkerDied

# torch's words for a worker's death (its other RuntimeErrors are a worker's own exceptions).
DEATH_WORDS = ("is killed by signal", "exited unexpectedly")
# The DataLoader iterators of the passes under way (for the SIGCHLD wrapper to name a dead worker).
_running: weakref.WeakSet[Any] = weakref.WeakSet()


def dead_worker(iterator: Any, grace_s: float = 2.0) -> str | None:
    """Which of a DataLoader iterator's worker processes died and how, in words; None when all live.

    Called on an error that a dying worker may cause before the kernel has its exit status (a
    multi-threaded process is reported once every thread is gone): waits up to `grace_s` for one to end."""
    from multiprocessing.connection import wait

    workers = list(getattr(iterator, "_workers", None) or [])
    ended = set(wait([w.sentinel for w in workers], timeout=grace_s)) if workers else set()
    for number, process in enumerate(workers):
        if process.sentinel not in ended:
            continue
        process.join()  # it has ended: reaps it (torch's SIGCHLD handler leaves it a zombie, waitid WNOWAIT)
        code = process.exitcode
        if code is None or code == 0:
            continue
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            how = f"was killed by {name}" + (" (the kernel's OOM killer sends it when memory runs out: see "
                                             "dmesg)" if -code == signal.SIGKILL else "")
        else:
            how = f"exited with status {code}"
        return f"worker {number} (pid {process.pid}) {how}"
    return None


def watch(iterator: Any) -> None:
    """A pass's DataLoader iterator starts: a death between its batches is told as `WorkerDied`."""
    name_deaths_on_sigchld()  # torch has installed its handler by now
    _running.add(iterator)


def unwatch(iterator: Any) -> None:
    _running.discard(iterator)


def name_deaths_on_sigchld() -> None:
    """torch's SIGCHLD handler raises its RuntimeError wherever the main thread happens to be when a worker
    dies (between batches: in the training step, far from any `next()`); wrapped once, so that error is a
    `WorkerDied` naming the worker and how it died, as a death met inside `next()` is."""
    if threading.current_thread() is not threading.main_thread():
        return  # torch installs no handler off the main thread either
    torchs = signal.getsignal(signal.SIGCHLD)
    if not callable(torchs) or getattr(torchs, "names_deaths", False):
        return

    def handler(signum: int, frame: Any) -> None:
        try:
            torchs(signum, frame)
        except RuntimeError as exc:
            if not any(words in str(exc) for words in DEATH_WORDS):
                raise
            died = next((d for it in list(_running) if (d := dead_worker(it, grace_s=0.5))), None)
            pid = re.search(r"pid\(?s?\)? ([\d, ]+)", str(exc))
            died = died or f"worker (pid {pid.group(1).strip() if pid else '?'}) died ({str(exc).strip()})"
            raise WorkerDied(f"torch: DataLoader {died}, between batches") from exc

    handler.names_deaths = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGCHLD, handler)


def quiet_when_the_consumer_left(worker_id: int) -> None:
    """A DataLoader worker's `worker_init_fn`. A worker hands each batch's shared memory to the consumer by
    passing a file descriptor from a background thread (multiprocessing's resource_sharer); when the consumer
    is stopped mid-handover (Ctrl-C, SIGTERM) that thread meets a broken pipe and prints its traceback under
    the consumer's own one-line account of the stop. Only that peer-gone error is dropped; any other goes to
    the hook it would have reached."""
    import sys

    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not issubclass(kind, (BrokenPipeError, ConnectionResetError)):
            previous(kind, exc, tb)

    sys.excepthook = hook
