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


class BackendUnavailable(LoadoptError):
    """A backend that cannot run here (package not installed, no GPU, ...)."""


class OutputError(LoadoptError):
    """An output folder or file that cannot be written."""


class StorageError(LoadoptError):
    """A storage tier that keeps failing: reads still erroring or timing out after every retry."""
