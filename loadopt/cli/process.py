"""How the `loadopt` process behaves around its commands: logging with credentials redacted, SIGTERM
stopping a command as Ctrl-C does, and a bug's traceback without the credentials a URL in it may hold."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from loadopt.errors import Terminated


def setup_logging(verbose: bool) -> None:
    """Log to stderr, every record with its credentials redacted."""
    from loadopt.storage.remote.access import RedactingFilter

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


@contextmanager
def terminate_as_interrupt(interrupted: list[bool] | None = None) -> Iterator[list[bool]]:
    """SIGTERM (Slurm, Kubernetes, `timeout`) stops the command as Ctrl-C does: `errors.Terminated`, a
    KeyboardInterrupt, is raised in the main thread once (a second SIGTERM is ignored, so the cleanup and
    the writing of the finished runs are not cut short). Yields a list holding True once it came; True is
    appended to `interrupted` once Ctrl-C came (for a caller to raise it again where a finaliser ate it)."""
    import signal
    import threading

    received: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    owner = os.getpid()
    interrupted = interrupted if interrupted is not None else []

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != owner:  # a forked worker inherited this handler: end it as SIGTERM always did
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if received:
            return
        received.append(True)
        raise Terminated()

    def unraisable(info: Any) -> None:  # our raise landed where Python ignores exceptions: raised again later
        if isinstance(info.exc_value, Terminated):
            return
        if received or interrupted:  # a finaliser of an object the stop cut short mid-construction (seen:
            # torch's DataLoader iterator without `_workers_status`): the stop is the cause, not a fault to print
            logging.getLogger("loadopt").debug("after the stop, ignored in %r: %r", info.object, info.exc_value)
            return
        previous_hook(info)

    current_int = signal.getsignal(signal.SIGINT)

    def interrupt(signum: int, frame: Any) -> None:  # Ctrl-C as it was handled, remembered for `unraisable`
        interrupted.append(True)
        if callable(current_int):
            current_int(signum, frame)
        else:
            signal.default_int_handler(signum, frame)

    previous, previous_hook = signal.signal(signal.SIGTERM, stop), sys.unraisablehook
    # Ctrl-C is remembered whoever handles it (Python's default, or a handler installed before: a caller's, or
    # one a library left), so a stop whose exception a finaliser ate is honoured; an ignored SIGINT stays so.
    previous_int = signal.signal(signal.SIGINT, interrupt) if callable(current_int) else None
    sys.unraisablehook = unraisable
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
        sys.unraisablehook = previous_hook


def stop_that_came(terminated: list[bool], interrupted: list[bool]) -> BaseException | None:
    """The stop `terminate_as_interrupt` saw (its lists), as the exception to raise again where its own raise may
    have been lost (a finaliser, a thread, a library's `except`): `Terminated` for SIGTERM, KeyboardInterrupt
    for Ctrl-C; None when neither came."""
    if terminated:
        return Terminated()
    return KeyboardInterrupt() if interrupted else None


def redacted_excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    """A bug keeps its traceback, without the credentials a URL in it may hold."""
    import traceback

    from loadopt.storage.remote.access import redact

    sys.stderr.write(redact("".join(traceback.format_exception(kind, exc, tb))))
