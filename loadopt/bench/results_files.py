"""Results files: `results.json` (schema-versioned) and the raw per-batch timings as Parquet.

Both files are written to temporary names in the same folder and only then renamed, together: a reader never
sees half a file, and a write that fails (a full disk) leaves the previous pair as it was, never a new
`results.json` beside the old timings. Before a bench first writes into a folder, an earlier bench's files there
(results, timings, report, decision) move into `runs/<when it was made>/` (`archive_previous`): no run is ever
overwritten, the newest is always at the folder's top, and `loadopt report` compares any two.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

from loadopt.errors import OutputError
from loadopt.files import honour_umask, is_no_space
from loadopt.schema.documents import ResultsFile, results_text

__all__ = ["STALE_FILES", "archive_previous", "discard_stale_files", "write_results"]

# What a bench leaves beside its results that describes them: the report (`loadopt.report`'s default name)
# and the decision.
STALE_FILES = ("report.html", "decision.json")
# A bench's own files in its output folder: what `archive_previous` moves aside as one run.
RUN_FILES = ("results.json", "timings.parquet", *STALE_FILES)
RUNS = "runs"  # the folder of earlier runs, one subfolder each


def archive_previous(folder: Path) -> Path | None:
    """Move the run an earlier bench left in `folder` (its results.json and the files beside it) into
    `runs/<its creation time>/`; returns where, or None when there was none. A run that cannot be moved (a
    read-only folder) stays, and this bench's files replace it, as before."""
    results = folder / "results.json"
    if not results.is_file():
        return None
    try:
        created = json.loads(results.read_text()).get("created") or ""
    except (OSError, ValueError, AttributeError):
        created = ""
    stamp = re.sub(r"[^0-9T]", "", created.split("+")[0])[:15] or f"mtime-{int(results.stat().st_mtime)}"
    target = folder / RUNS / stamp
    suffix = 1
    while target.exists():
        suffix += 1
        target = folder / RUNS / f"{stamp}-{suffix}"
    try:
        target.mkdir(parents=True)
        for name in RUN_FILES:
            if (folder / name).exists():
                os.replace(folder / name, target / name)
    except OSError:
        return None
    return target


def write_results(folder: Path, results: ResultsFile, timing_rows: dict[str, list]) -> tuple[Path, Path]:
    """Write `results.json` and `timings.parquet` into `folder` (both or neither); returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    json_path, parquet_path = folder / "results.json", folder / "timings.parquet"
    staged: list[str] = []
    try:
        table = pa.table(timing_rows)
        text = results_text(results)  # validated against loadopt.schema.documents
        parquet_tmp, json_tmp = _staged(parquet_path, staged), _staged(json_path, staged)
        pq.write_table(table, parquet_tmp)
        Path(json_tmp).write_text(text)
        os.replace(parquet_tmp, parquet_path)
        os.replace(json_tmp, json_path)
    except OSError as exc:
        if is_no_space(exc):
            raise OutputError(f"{folder}: no space left on device to write the results; the previous results, "
                              "if any, are unchanged") from None
        raise OutputError(f"{folder}: cannot write results ({exc.strerror or exc})") from None
    finally:
        for tmp in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a temporary not renamed (a failure, or an interrupt): gone
    return json_path, parquet_path


def _staged(path: Path, staged: list[str]) -> str:
    """A temporary file beside `path` with the mode a plain `open` gives, noted in `staged`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    staged.append(tmp)
    honour_umask(tmp)
    return tmp


def discard_stale_files(folder: Path) -> list[str]:
    """Remove the report and decision an earlier bench left in `folder`; returns the names it could not remove
    (with why), for a warning."""
    left = []
    for name in STALE_FILES:
        try:
            (folder / name).unlink(missing_ok=True)
        except OSError as exc:
            left.append(f"{name} ({exc.strerror or exc})")
    return left
