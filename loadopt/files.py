"""Files and folders every layer shares: the cache folder, YAML files read with one-line errors, and
writes that never leave half a file (a temporary name in the same folder, then a rename).

A leaf: it imports nothing of loadopt's but its errors, so storage, loaders, the harness and the CLI
can all use it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from loadopt.errors import ConfigError, OutputError

__all__ = ["atomic_write", "atomic_write_text", "cache_dir", "current_umask", "discard_output", "honour_umask",
           "is_no_space", "prepare_output", "read_yaml", "yaml_problem"]


def cache_dir() -> Path:
    """The folder for generated datasets and decisions: `$LOADOPT_CACHE`, default ~/.cache/loadopt."""
    return Path(os.environ.get("LOADOPT_CACHE") or Path.home() / ".cache" / "loadopt").expanduser()


# ---------------------------------------------------------------------------------------------
# YAML


def yaml_problem(exc: yaml.YAMLError) -> str:
    """`line N: invalid YAML: <what>` for a YAML parse error (the line where PyYAML knows it)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    return f"{where}invalid YAML: {getattr(exc, 'problem', None) or str(exc).splitlines()[0]}"


def read_yaml(path: Path, what: str, missing_hint: str = "") -> Any:
    """The parsed YAML file at `path` (`what` it is, for the messages); every failure one `ConfigError` line
    naming the file."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found{missing_hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the {what} ({exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: {yaml_problem(exc)}") from None


# ---------------------------------------------------------------------------------------------
# Permissions and space


def current_umask() -> int:
    """The process's umask (read from /proc where it is there: setting it to read it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike[str], folder: bool = False) -> None:
    """Give a file made by `mkstemp`/`mkdtemp` (mode 0600/0700) the mode a plain `open`/`mkdir` gives."""
    os.chmod(path, (0o777 if folder else 0o666) & ~current_umask())


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc` says the disk (or the quota) is full; Arrow's I/O errors carry no errno."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, OSError) and ("No space left on device" in str(exc) or "Disk quot" in str(exc))


# ---------------------------------------------------------------------------------------------
# Atomic writes and output folders


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call `write(tmp_path)`, then rename the temporary file onto `path`, which gets the mode a plain
    `open` gives (the umask's: a teammate can read the report), not mkstemp's 0600. A full disk is
    one line naming the folder; the previous file stays as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        honour_umask(tmp)
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_no_space(exc):
            raise OutputError(f"{path.parent}: no space left on device to write {path.name}; the previous "
                              "file, if any, is unchanged") from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def prepare_output(out: str | os.PathLike[str]) -> Path:
    """Create the output folder and check it can be written, before any work is done (`discard_output`
    removes it again, with the parents it had to create, if the job fails before writing anything)."""
    folder = Path(out).expanduser()
    missing = [p for p in [folder, *folder.parents] if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".loadopt-write-check.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{folder}: cannot write the output folder ({exc.strerror or exc})") from None
    _CREATED_PARENTS[folder.absolute()] = [p.absolute() for p in missing[1:]]
    return folder


# Per output folder made by `prepare_output`, the parents it made for it (`results/` of `results/probe`).
_CREATED_PARENTS: dict[Path, list[Path]] = {}


def discard_output(folder: Path, existed: bool) -> None:
    """Remove an output folder that `prepare_output` created for a job that then failed before writing a
    file: a refused run leaves no empty results folder behind. A folder the user had is never touched."""
    if existed:
        return
    for made in [folder.absolute(), *_CREATED_PARENTS.pop(folder.absolute(), [])]:
        try:
            made.rmdir()  # only succeeds while empty
        except OSError:
            return
