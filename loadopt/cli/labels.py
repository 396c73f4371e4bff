"""Short labels for the terminal's table: a setting named by its backend, its form words and only the knobs
that vary between the bench's settings of that backend (`torch tuned w=2`), so the table fits 120 columns.
The full label stays in results.json, the report and the verdicts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadopt.schema.documents import Run

# The knobs' short names in the table (the full names are in results.json's settings).
SHORT_KEYS = {"num_workers": "w", "num_threads": "t", "threads": "t", "io_threads": "io", "prefetch": "pf",
              "prefetch_factor": "pf", "read_ahead": "ra", "o_direct": "direct", "normalise": "norm"}
LABEL_WIDTH = 28


def _words(label: str, backend: str) -> tuple[list[str], dict[str, str]]:
    """The label's plain words (after the backend's name) and its `key=value` knobs."""
    rest = label.split()[1:] if label.split()[:1] == [backend] else label.split()
    words = [w for w in rest if "=" not in w]
    knobs = dict(w.split("=", 1) for w in rest if "=" in w)
    return words, knobs


def short_labels(runs: Sequence[Run]) -> dict[str, str]:
    """Each run's label -> its short form: the backend, its plain words, then the knobs whose values differ
    between that backend's runs (`w=1`, `w=2`); two runs never share a short label."""
    parsed: dict[str, tuple[str, list[str], dict[str, str]]] = {}
    for run in runs:
        backend = run.backend or run.label.split()[0]
        parsed[run.label] = (backend, *_words(run.label, backend))
    values_of: dict[tuple[str, str], set[str]] = {}  # (backend, knob) -> the values its runs have
    for backend, _, knobs in parsed.values():
        for key, value in knobs.items():
            values_of.setdefault((backend, key), set()).add(value)
    short: dict[str, str] = {}
    for label, (backend, words, knobs) in parsed.items():
        shown = [f"{SHORT_KEYS.get(k, k)}={v}" for k, v in knobs.items() if len(values_of[(backend, k)]) > 1]
        short[label] = _clip(" ".join([backend, *_plain(words), *shown]))
    return _unique(short)


def _plain(words: Iterable[str]) -> list[str]:
    """Form words, shortened where a long one says little in a table (`whole 512px` -> `512px`)."""
    return [w for w in words if w not in ("whole",)]


def _clip(text: str) -> str:
    return text if len(text) <= LABEL_WIDTH else text[: LABEL_WIDTH - 1] + "…"


def _unique(short: dict[str, str]) -> dict[str, str]:
    """Number the short labels that two settings would share (`#1`, `#2`): the table must tell them apart."""
    counts: dict[str, int] = {}
    for value in short.values():
        counts[value] = counts.get(value, 0) + 1
    seen: dict[str, int] = {}
    out = {}
    for label, value in short.items():
        if counts[value] > 1:
            seen[value] = seen.get(value, 0) + 1
            value = _clip(value[: LABEL_WIDTH - 3]) + f" #{seen[value]}"
        out[label] = value
    return out
