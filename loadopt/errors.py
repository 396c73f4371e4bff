"""User-facing errors.

Anything a user can cause (bad config, missing path, corrupt file, backend not installed) raises a
subclass of `LoadoptError` whose message is one line naming the thing at fault. The CLI prints that
line and exits with `exit_code`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class LoadoptError(Exception):
    """An error the user can fix; its message is one line naming the culprit."""

    exit_code = 1


class ConfigError(LoadoptError):
    """A config file or override that does not validate."""

    exit_code = 2


class DatasetError(LoadoptError):
    """A dataset that is missing, empty or holds a file that cannot be read or decoded."""


class DatasetChanged(DatasetError):
    """A file of a remote dataset that vanished or changed since its listing was saved.
    `name` is the file as messages show it, `reason` the rest of the line; both
    are the exception's args, so it pickles across the loaders' worker processes."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, reason)
        self.name, self.reason = name, reason

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


class BackendUnavailable(LoadoptError):
    """A backend that cannot run here (package not installed, no GPU, ...)."""


class OutputError(LoadoptError):
    """An output folder or file that cannot be written."""


class StorageError(LoadoptError):
    """A storage tier that keeps failing: reads still erroring or timing out after every retry, or refused for
    good (`read_with_retries`). Never a damaged sample: `describe_sample_error` raises it, so
    it ends the read under `dataset.on_error: skip` too. Its one argument is its line, so it pickles across
    worker processes; torch's DataLoader re-raises a worker's exception with its traceback as the message,
    which is cut back to that line here."""

    def __init__(self, message: str = "") -> None:
        super().__init__(_worker_line(message, type(self).__name__))


def _worker_line(message: str, name: str) -> str:
    """`message`, or where it is torch's "Caught <name> in DataLoader worker process N. Original Traceback
    ..." the line the worker raised (its traceback's last line, less the exception's type)."""
    if not message.startswith(f"Caught {name} ") or "Original Traceback" not in message:
        return message
    last = next((line for line in reversed(message.splitlines()) if line.strip()), message)
    _, sep, rest = last.strip().partition(f"{name}: ")
    return rest if sep else last.strip()


class WorkerDied(LoadoptError):
    """A loader's worker process that died under it (killed by a signal: the kernel's OOM killer, a
    `kill`; or exited): which worker, and how."""


def shown_name(name: str) -> str:
    """A file name as a one-line message shows it: as it is, or, where it holds a control character (a
    newline would split the line) or spaces at its ends, as Python's repr (quoted, escaped)."""
    return name if name.isprintable() and name == name.strip() else repr(name)


def describe_sample_error(exc: BaseException) -> str:
    """What was wrong with a sample, in words: PIL's "cannot identify image file <_io.BytesIO object at
    0x...>" says which in-memory buffer, not what is wrong; the file is named by the caller. A `StorageError`
    is no sample's fault and is raised again, to end the read whatever `dataset.on_error` says; so is a
    `DatasetChanged` (the file changed since its listing: `--relist`, not a skip, is the fix)."""
    import re

    if isinstance(exc, StorageError):  # the storage failed, not the sample: no on_error skips it
        raise exc
    if isinstance(exc, DatasetChanged):  # a stale listing, not a damaged sample: --relist is the fix, not a skip
        raise exc
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, SampleProblem):
        return text
    name = type(exc).__name__
    if name == "UnidentifiedImageError" or text.startswith("cannot identify image file"):
        return "not a readable image (no known image format: damaged or not an image)"
    if text.startswith("tj"):  # simplejpeg (libjpeg-turbo): "tjDecompress2(): <what is wrong>"
        return f"damaged JPEG (libjpeg-turbo: {text.split('(): ', 1)[-1]})"
    if "truncated" in text.lower() or name == "EOFError" or "NEED_MORE_INPUT" in text:  # the last: libjxl's
        return f"truncated image ({re.sub(r'<[^>]* at 0x[0-9a-fA-F]+>', 'the file', text) or name})"
    text = re.sub(r"<[^>]* at 0x[0-9a-fA-F]+>", "the file", text)
    return f"cannot decode ({name}: {text})" if text else f"cannot decode ({name})"


class SampleProblem(Exception):  # noqa: N818 - a sample's failure, not an error of the program
    """A sample that could not be made, its message already the reason in words (a user's transform that raised
    or returned the wrong thing): reported as it is, under `dataset.on_error` as a damaged file is."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm, Kubernetes and `timeout` send), raised in the main thread as Ctrl-C's
    KeyboardInterrupt is, so that everything that stops cleanly on Ctrl-C stops cleanly on it too."""

    exit_code = 143  # 128 + SIGTERM, what a shell reports for a process the signal ended


def stop_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM that an error was raised while handling, if any: e.g. torch's DataLoader stopped
    while starting its workers raises "cannot join thread before it is started" from its cleanup."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__context__
    return None
