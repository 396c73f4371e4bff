"""`loadopt report`: results files as one self-contained HTML page, or a short Markdown summary.

    from loadopt.report import write_report
    write_report(["results/imagenet/results.json"])            # -> results/imagenet/report.html
    write_report(["before/results.json", "after/results.json"], "cmp.html")   # side by side, ratios
    render_report(["results/imagenet"], fmt="markdown")         # text for a pull request

A results argument is a `results.json` / `measure.json` file or the folder holding it; the per-batch
`timings.parquet` beside it feeds the latency and over-time sections. The optional keys a report
reads (ceilings, decision, verdicts, tiers) are described in `loadopt.report.data`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from loadopt.errors import OutputError
from loadopt.report.data import ResultsFileError, load_all

__all__ = ["FORMATS", "ReportError", "ResultsFileError", "default_output", "render_report", "write_report"]

FORMATS = {"html": "report.html", "markdown": "report.md"}
PathLike = str | os.PathLike[str]


class ReportError(ResultsFileError):
    """A report that cannot be made as asked (e.g. an unknown format)."""


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ReportError(f"--format {fmt}: unknown report format (known: {', '.join(FORMATS)})")


def render_report(paths: Sequence[PathLike], fmt: str = "html") -> str:
    """The report's text: the HTML page, or the Markdown summary."""
    _check_format(fmt)
    serving = _serving(paths)
    if serving is not None:
        from loadopt.report import serve_page

        return serve_page.render(serving) if fmt == "html" else serve_page.markdown(serving)
    files = load_all(list(paths))
    if fmt == "markdown":
        from loadopt.report import markdown

        return markdown.render(files)
    from loadopt.report import html  # matplotlib is only imported for the page

    return html.render(files)


def _serve_file(path: PathLike) -> Path | None:
    """`path` as a serving bench's serve.json (the file, or a folder holding it and no other results), else None."""
    given = Path(path).expanduser()
    if given.is_dir() and not (given / "results.json").is_file() and not (given / "measure.json").is_file():
        given = given / "serve.json"
    return given if given.name == "serve.json" and given.is_file() else None


def _serving(paths: Sequence[PathLike]):
    """The serving bench's results when `paths` is one serve.json (None for the other results files)."""
    import json

    from pydantic import ValidationError

    from loadopt.schema.serve import ServeResults

    if not paths:
        return None
    first = _serve_file(paths[0])
    if first is None:
        return None
    if len(paths) > 1:
        raise ReportError(f"{first}: a serving bench's results are reported alone (no side-by-side comparison yet)")
    try:
        return ServeResults.model_validate(json.loads(first.read_text()))
    except (OSError, ValueError, ValidationError) as exc:
        raise ResultsFileError(f"{first}: not a loadopt serve.json ({str(exc).splitlines()[0]})") from None


def default_output(paths: Sequence[PathLike], fmt: str = "html") -> Path:
    """`report.html` (or `report.md`) beside the first results file."""
    from loadopt.report.data import resolve

    _check_format(fmt)
    if not paths:
        raise ResultsFileError("no results file given")
    serving = _serve_file(paths[0])
    return (serving or resolve(paths[0])).parent / FORMATS[fmt]


def write_report(paths: Sequence[PathLike], out: PathLike | None = None, fmt: str = "html") -> Path:
    """Render the report of `paths` and write it atomically to `out` (default: beside the first file)."""
    from loadopt.files import atomic_write_text

    text = render_report(paths, fmt)
    target = Path(out).expanduser() if out is not None else default_output(paths, fmt)
    if target.is_dir():
        target = target / FORMATS[fmt]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, text)
    except OSError as exc:
        raise OutputError(f"{target}: cannot write the report ({exc.strerror or exc})") from None
    return target
