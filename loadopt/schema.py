"""The one results schema: `results.json` (loadopt bench), `measure.json` (loadopt measure), `tiers.json`
(loadopt tiers) and `decision.json` (and the cache's decision entries), as pydantic models with a
`schema_version`. Every writer writes through `results_text` / `decision_text`, every reader reads
through `read_results` / `parse_results` / `parse_decision`.

The models name the keys the readers rely on; everything else a producer, backend or plugin records is
kept as it is (`extra="allow"`), so no recorded figure is dropped. Versions:
- 1: the first; tiers rows stored several values under two keys (`tier`/`name`, `measured`/
  `accelerators_supported`, `predicted`/`predicted_accelerators`, `cost.per_accelerator_month`/
  `cost_per_supported_accelerator`) and tiers.json had no `schema_version`.
- 2: each value under one key (`name`, `accelerators_supported`, `predicted_accelerators`,
  `cost_per_supported_accelerator`); tiers.json and decisions carry `schema_version`.
  Version 1 files are read and upgraded.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import TypedDict

from loadopt.errors import LoadoptError

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)


class SchemaError(LoadoptError):
    """A results or decision file that is corrupt, not loadopt's, or of a version this loadopt cannot read."""


class RunStatus(str, Enum):
    """What became of one setting (bench), iterable or rank (measure): its `status` in the files."""

    OK = "ok"
    UNAVAILABLE = "unavailable"  # its backend cannot run here or does not read this dataset
    ERROR = "error"  # it failed; the reason says how
    NOT_RUN = "not run"  # the bench stopped (interrupted, or at an error) before it
    MISSING = "missing"  # a rank whose results never came (measure under torchrun)

    def __str__(self) -> str:
        return self.value


# One figure of a run: a rate, a fraction, a count, a flag (h2d_pinned), a note (measure's compute_source),
# or None where it was not measured.
Figure = float | int | bool | str | None


class Spread(TypedDict):
    """One metric over the repeats of a setting."""

    median: float
    min: float
    max: float


RepeatMetrics = dict[str, Figure]  # the flat metrics of one repeat (loadopt.bench.metrics.step_metrics)
RunMetrics = dict[str, Spread | Figure]  # per metric its Spread over the repeats, or the one value


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Run(_Open):
    """One loader setting (bench), measured iterable or rank (measure) of a results file."""

    label: str
    backend: str = ""
    status: RunStatus = RunStatus.OK
    reason: str = ""
    settings: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None  # per metric: {median, min, max} over the repeats, or the value
    repeats: list[dict[str, Any]] = []  # the flat metrics of each repeat (loadopt.bench.metrics.step_metrics)


class TierCost(_Open):
    per_month: float | None = None  # the capacity stored, at the tier's price


class TierRow(_Open):
    """One storage tier of `loadopt tiers` (or a bench results file's `tiers` section)."""

    name: str
    au_threshold: float | None = None
    accelerators_supported: int | None = None  # measured
    predicted_accelerators: int | None = None
    measured_note: str = ""
    delivered_mb_s: float | None = None
    samples_per_s: float | None = None
    accelerator_utilisation: float | None = None
    cpu_load: float | None = None
    price_per_tb_month: float | None = None
    cost_per_supported_accelerator: float | None = None  # $ a month per accelerator kept at the threshold
    cost: TierCost = TierCost()
    bounded_by_base: str | None = None  # an emulated tier over slower storage: what its figures are instead

    @model_validator(mode="before")
    @classmethod
    def _one_key_each(cls, data: Any) -> Any:
        """Version 1 rows: the same value under two keys; keep the one key of version 2."""
        if not isinstance(data, dict):
            return data
        row = dict(data)
        for old, new in (("tier", "name"), ("measured", "accelerators_supported"),
                         ("predicted", "predicted_accelerators")):
            if old in row:
                value = row.pop(old)
                row.setdefault(new, value)
        if isinstance(row.get("cost"), dict) and "per_accelerator_month" in row["cost"]:
            cost = dict(row["cost"])
            row.setdefault("cost_per_supported_accelerator", cost.pop("per_accelerator_month"))
            row["cost"] = cost
        return row


class _Versioned(_Open):
    """A file's top level: its `schema_version` checked (and set for version 1 files, which had none)."""

    @model_validator(mode="before")
    @classmethod
    def _versioned(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {**data, "schema_version": _version(data)}
        return data


class ResultsFile(_Versioned):
    """results.json, measure.json and tiers.json: runs (none for tiers), ranking, summary."""

    schema_version: int = SCHEMA_VERSION
    command: str = ""
    created: str | None = None
    device: str | None = None
    machine: dict[str, Any] | None = None
    runs: list[Run]
    ranking: list[str] = []
    summary: str = ""
    # a row that is not a tier (no name) is kept as it is: the report skips it, the rest still renders
    tiers: list[Annotated[TierRow | Any, Field(union_mode="left_to_right")]] | None = None


class Decision(_Versioned):
    """What a bench (or a tier of `loadopt tiers`) decided: `decision.json` and each cache entry."""

    schema_version: int = SCHEMA_VERSION
    backend: str
    label: str = ""
    settings: dict[str, Any] | None = None
    samples_per_s: float | None = None
    margin: float | None = None
    text: str = ""
    dataset_fingerprint: str | None = None
    pipeline: dict[str, Any] | None = None
    machine: dict[str, Any] | None = None
    machine_fingerprint: str | None = None
    partial: bool = False  # a bench stopped before every setting ran: written beside its results, never cached
    not_compared: list[str] = []  # a partial decision's settings that were not measured


def _version(data: dict[str, Any]) -> int:
    version = data.get("schema_version", 1)  # version 1 tiers.json and decisions had none
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
        raise ValueError(f"schema_version {version!r} is not one this loadopt reads "
                         f"({', '.join(map(str, READABLE_VERSIONS))}): written by another loadopt version?")
    return SCHEMA_VERSION  # read, upgraded


def _problem(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def parse_results(doc: Any, source: str | Path) -> ResultsFile:
    """Validate (and upgrade) one results document; a bad one is a SchemaError naming `source`."""
    try:
        return ResultsFile.model_validate(doc)
    except ValidationError as exc:
        raise SchemaError(f"{source}: not a loadopt results file of a known shape ({_problem(exc)})") from None


def parse_decision(doc: Any, source: str | Path) -> Decision:
    try:
        return Decision.model_validate(doc)
    except ValidationError as exc:
        raise SchemaError(f"{source}: not a loadopt decision of a known shape ({_problem(exc)})") from None


def as_dict(model: BaseModel) -> dict[str, Any]:
    """The document as plain JSON-shaped data: the keys it was given (and the upgraded ones), no defaults added."""
    data = model.model_dump(exclude_unset=True)
    if "schema_version" in type(model).model_fields:
        data["schema_version"] = SCHEMA_VERSION
    return data


def read_json(path: str | Path) -> Any:
    """A JSON file's content; unreadable or not JSON is a SchemaError naming the file."""
    p = Path(path).expanduser()
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise SchemaError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"{p}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    except ValueError as exc:
        raise SchemaError(f"{p}: not valid JSON ({str(exc).splitlines()[0]})") from None


def read_results(path: str | Path) -> dict[str, Any]:
    """A results file (results.json, measure.json, tiers.json; any readable version), validated and upgraded."""
    return as_dict(parse_results(read_json(path), path))


def results_text(doc: dict[str, Any]) -> str:
    """The JSON text of a results document, validated against the schema (a writer's bug fails here, loudly)."""
    return _dumps(as_dict(ResultsFile.model_validate({"schema_version": SCHEMA_VERSION, **doc})))


def decision_text(doc: dict[str, Any]) -> str:
    return _dumps(as_dict(Decision.model_validate({"schema_version": SCHEMA_VERSION, **doc})))


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=_jsonable) + "\n"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
