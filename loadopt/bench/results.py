"""Results files: `results.json` (schema-versioned) and the raw per-batch timings as Parquet.

Files are written to a temporary name in the same folder and renamed (`loadopt.files.atomic_write`), so a
reader never sees half a file and an interrupted bench never destroys the previous results.
"""

from __future__ import annotations

from pathlib import Path

from loadopt.errors import OutputError
from loadopt.files import atomic_write, atomic_write_text
from loadopt.schema import ResultsFile, results_text

__all__ = ["write_results"]


def write_results(folder: Path, results: ResultsFile, timing_rows: dict[str, list]) -> tuple[Path, Path]:
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

