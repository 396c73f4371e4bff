"""Results files: `results.json` (schema-versioned) and the raw per-batch timings as Parquet.

Files are written to a temporary name in the same folder and renamed, so a reader never sees half a
file and an interrupted bench never destroys the previous results.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil

from loadopt.device import usable_cores
from loadopt.errors import OutputError
from loadopt.schema import SCHEMA_VERSION, results_text

__all__ = ["SCHEMA_VERSION", "atomic_write", "atomic_write_text", "machine_fingerprint", "machine_info",
           "discard_output", "prepare_output", "write_results"]
LIBRARIES = ("loadopt", "torch", "numpy", "pyarrow", "fsspec", "pillow", "simplejpeg", "nvidia-dali-cuda120",
             "nvidia-dali-cuda130", "kvikio-cu12", "kvikio-cu13", "torchvision")


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call `write(tmp_path)`, then rename the temporary file onto `path`, which gets the mode a plain
    `open` gives (the umask's: a teammate can read the report), not mkstemp's 0600. A full disk is
    one line naming the folder; the previous file stays as it was."""
    from loadopt.storage.integrity import honour_umask, is_no_space

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
    removes it again if the job fails before writing anything)."""
    folder = Path(out).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".loadopt-write-check.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{folder}: cannot write the output folder ({exc.strerror or exc})") from None
    return folder


def discard_output(folder: Path, existed: bool) -> None:
    """Remove an output folder that `prepare_output` created for a job that then failed before writing a
    file: a refused run leaves no empty results folder behind. A folder the user had is never touched."""
    if existed:
        return
    with contextlib.suppress(OSError):
        folder.rmdir()  # only succeeds while empty


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    if versions["loadopt"] is None:  # run from a source tree on PYTHONPATH, not installed
        from loadopt import __version__

        versions["loadopt"] = __version__
    return versions


def machine_info() -> dict[str, Any]:
    import torch

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "count": torch.cuda.device_count(), "memory_gb": props.total_memory / 2**30,
               "cuda": torch.version.cuda}
    cores = usable_cores()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": cores,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpu,
        "libraries": library_versions(),
    }


def machine_fingerprint(machine: dict[str, Any]) -> str:
    """What makes two machines comparable for a decision: CPU, cores, RAM, GPU."""
    gpu = machine.get("gpu") or {}
    key = json.dumps([machine["cpu_model"], machine["cpu_count"], round(machine["ram_gb"]), gpu.get("name"),
                      gpu.get("count")])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def write_results(folder: Path, results: dict[str, Any], timing_rows: dict[str, list]) -> tuple[Path, Path]:
    """Write `results.json` and `timings.parquet` into `folder`; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    json_path, parquet_path = folder / "results.json", folder / "timings.parquet"
    try:
        table = pa.table(timing_rows)
        atomic_write(parquet_path, lambda tmp: pq.write_table(table, tmp))
        atomic_write_text(json_path, results_text(results))  # validated against loadopt.schema
    except OSError as exc:
        raise OutputError(f"{folder}: cannot write results ({exc.strerror or exc})") from None
    return json_path, parquet_path

