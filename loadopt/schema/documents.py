"""The one results schema: `results.json` (loadopt bench), `measure.json` (loadopt measure), `tiers.json`
(loadopt tiers) and `decision.json` (and the cache's decision entries), as pydantic models with a
`schema_version`. Every writer writes through `results_text` / `decision_text`, every reader reads
through `read_results_file` (`read_results`: as plain data) / `parse_results` / `parse_decision`.

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

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator, with_config
from typing_extensions import Required, TypedDict

from loadopt.errors import LoadoptError
from loadopt.machine import MachineInfo
from loadopt.schema.ceilings import Ceilings, RunCeiling, StageMeasurement, Verdict
from loadopt.schema.metrics import DistributedNote, RankFigures, RepeatMetrics, RunMetrics, SlowestRank
from loadopt.schema.tiers import TierRow

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


# A backend's knob settings: its setting model's `model_dump(mode="json")`. The knobs are each backend's own (an
# outside backend's may hold any JSON value), so the values are JSON's, not a narrower union.
Knobs = dict[str, JsonValue]


def knobs_of(settings: BaseModel) -> Knobs:
    """A backend's setting as the files record it (a tuple a list, an enum its value: what JSON would make of it)."""
    return settings.model_dump(mode="json")


# A config section (or a tier's spec) as the files hold it: its model's `model_dump(mode="json")`, redacted.
ConfigDump = dict[str, JsonValue]


@with_config(ConfigDict(extra="allow"))  # a key an outside backend adds is kept, as the files held it
class Recipe(TypedDict, total=False):
    """The training input a loader delivers (loadopt.recipe's docstring says each field); a record in results.json."""

    kind: Required[str]  # images | tokens | records
    seq_len: int  # tokens
    image_size: int
    normalise: str
    crop: str
    stored: str
    max_side: int | None
    order: str
    transform: str  # the job's own per-sample transform (`pipeline.transform`), where there is one


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class SkippedFile(_Open):
    """An unreadable file a run skipped (dataset.on_error: skip), and how many times its repeats met it."""

    path: str
    reason: str
    times: int = 0


class RunTuned(_Open):
    """`loadopt bench --tune`: how the search reached a run's setting."""

    tried: int
    space_size: int
    note: str = ""


class Run(_Open):
    """One loader setting (bench), measured iterable or rank (measure) of a results file. The bench's runs
    also say where their bytes came from and what training input they deliver, the ceiling they are held
    to and, under torchrun, their ranks' figures."""

    label: str
    backend: str = ""
    status: RunStatus = RunStatus.OK
    reason: str = ""
    settings: Knobs | None = None  # the backend's knobs: its own, open
    metrics: RunMetrics | None = None  # per metric: its Spread over the repeats, or the one value
    repeats: list[RepeatMetrics] = []  # the flat metrics of each repeat (loadopt.bench.metrics.step_metrics)
    bytes_source: str | None = None  # the local disk read directly, or the storage tier every read passed
    recipe: Recipe | None = None  # the training input it delivers (loadopt.recipe)
    skipped_files: list[SkippedFile] = []
    tier_counters: dict[str, int | float] | None = None  # reads, retries, faults of the tier over every repeat
    bounded_by_base: str | None = None  # an emulated tier over slower storage: what its figures are instead
    tuned: RunTuned | None = None
    # declared in the order the bench adds them, so that results.json keeps its keys' order
    ranks: list[RankFigures] = []  # a torchrun bench: each rank's figures
    slowest_rank: SlowestRank | None = None  # a torchrun bench
    ceiling: RunCeiling | None = None  # the ceiling of the stage that bounds it
    fraction_of_ceiling: float | None = None  # None where the ceiling is unreliable or unmeasured


class _Versioned(_Open):
    """A file's top level: its `schema_version` checked (and set for version 1 files, which had none)."""

    @model_validator(mode="before")
    @classmethod
    def _versioned(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {**data, "schema_version": _version(data)}
        return data


class TrialRecord(_Open):
    """One short run of the `--tune` search (the tuner's `Trial`)."""

    label: str
    settings: Knobs
    samples_per_s: float | None = None
    measured_batches: int = 0
    seconds: float = 0.0
    outcome: str = "ok"  # ok | stopped early | cut by the budget | error
    reason: str = ""


class Refusal(_Open):
    """A setting of the search never run: over the machine, or its conversion missing."""

    settings: Knobs
    reason: str


class BackendTuningRecord(_Open):
    """One backend's search (the tuner's `BackendTuning`)."""

    backend: str
    status: RunStatus = RunStatus.OK
    reason: str = ""
    space: dict[str, list[Any]] = {}  # per knob, the values searched: the backend's own
    space_size: int = 0
    tried: int = 0
    refused: list[Refusal] = []
    best: TrialRecord | None = None
    budget_share_s: float = 0.0
    seconds: float = 0.0
    trials: list[TrialRecord] = []


class TuningSummary(_Open):
    """results.json `tuning`: the `--tune` search's trace."""

    method: str
    budget_s: float
    seconds: float
    backends: list[BackendTuningRecord] = []


class DatasetSection(_Open):
    """results.json `dataset`: what was read (its root redacted of credentials)."""

    root: str = ""
    format: str = ""  # imagefolder | webdataset | parquet | tokens | records (empty in files before it)
    fingerprint: str = ""
    synthetic: bool = False
    num_samples: int = 0
    num_classes: int = 0
    total_bytes: int = 0
    mean_sample_bytes: float = 0.0
    left_out: list[str] = []  # samples left out when indexed (dataset.on_error: skip), each named


class CacheSection(_Open):
    """results.json `cache`: the page cache's mode, and what was done to it."""

    mode: str = ""
    note: str = ""


class RunnerUp(_Open):
    label: str
    backend: str
    samples_per_s: float | None = None


class Excluded(_Open):
    """A measured setting a decision never chose: it delivers another training input."""

    label: str
    differences: list[str]


class MachineKey(_Open):
    """The machine a decision was made on: what `auto` compares with the machine it runs on."""

    fingerprint: str | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None
    gpu: str | None = None
    storage_tier: str | None = None


class Decision(_Versioned):
    """What a bench (or a tier of `loadopt tiers`) decided: `decision.json` and each cache entry."""

    schema_version: int = SCHEMA_VERSION
    backend: str
    label: str = ""
    settings: Knobs | None = None
    samples_per_s: float | None = None
    margin: float | None = None
    text: str = ""
    dataset_fingerprint: str | None = None
    pipeline: ConfigDump | None = None  # the config's pipeline section: part of the key
    machine: MachineKey | None = None
    machine_fingerprint: str | None = None
    partial: bool = False  # a bench stopped before every setting ran: written beside its results, never cached
    not_compared: list[str] = []  # a partial decision's settings that were not measured
    runner_up: RunnerUp | None = None  # the best setting of another backend
    tuned: bool = False
    recipe: Recipe | None = None  # the training input the setting delivers (loadopt.recipe)
    excluded: list[Excluded] = []
    passed_over_for_order: list[str] = []
    bounded_by_base: str | None = None
    created: str | None = None
    date: str | None = None
    loadopt_version: str | None = None
    config_source: str | None = None
    device: str | None = None
    pipeline_hash: str | None = None


class DecisionNote(_Open):
    """A results file's decision as older or hand-written files hold it: a setting and a sentence."""

    label: str = ""
    text: str = ""


class ResultsFile(_Versioned):
    """results.json, measure.json and tiers.json: runs (none for tiers), ranking, summary; a bench's results
    also its config, dataset, workload, cache and tier sections, the tuning and the decision, the ceilings
    and verdicts, the stages measured apart and how a torchrun bench's ranks ran."""

    schema_version: int = SCHEMA_VERSION
    command: str = ""
    created: str | None = None
    device: str | None = None
    machine: MachineInfo | None = None  # loadopt.machine.machine_info(), and the bench's `load`
    runs: list[Run]
    ranking: list[str] = []
    summary: str = ""
    # a row that is not a tier (no name) is kept as it is: the report skips it, the rest still renders
    tiers: list[Annotated[TierRow | Any, Field(union_mode="left_to_right")]] | None = None
    config_source: str | None = None
    config: ConfigDump | None = None  # the config as run, redacted
    quick: bool = False
    interrupted: bool = False
    interrupted_by: str | None = None  # SIGINT or SIGTERM
    machine_fingerprint: str | None = None
    tier: ConfigDump | None = None  # the storage tier's profile, redacted (TierSpec.redacted)
    dataset: DatasetSection | None = None
    workload: ConfigDump | None = None  # the workload as run
    cache: CacheSection | None = None
    recipe: Recipe | None = None  # the config's training input (loadopt.recipe)
    tuning: TuningSummary | None = None
    # a bench's decision; older files may hold only a setting and a sentence
    decision: Annotated[Decision | DecisionNote, Field(union_mode="left_to_right")] | None = None
    # declared in the order the bench adds them, so that results.json keeps its keys' order
    distributed: DistributedNote | None = None  # a torchrun bench
    ceilings: Ceilings | None = None  # the machine's, measured in the bench's own run
    # per backend's best setting; an older or hand-written file may hold plain sentences
    verdicts: list[Annotated[Verdict | str, Field(union_mode="left_to_right")]] = []
    stages: list[StageMeasurement] = []  # each backend's best setting measured stage by stage

    def measured(self) -> list[Run]:
        """The measured runs, in the ranking's order (fastest first)."""
        by_label = {r.label: r for r in self.runs}
        return [by_label[label] for label in self.ranking]


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
    """A results file (results.json, measure.json, tiers.json; any readable version), validated and upgraded,
    as plain JSON-shaped data (for the readers of a tier row's open sections)."""
    return as_dict(read_results_file(path))


def read_results_file(path: str | Path) -> ResultsFile:
    """A results file (any readable version), validated and upgraded, as the schema's model."""
    return parse_results(read_json(path), path)


def results_text(doc: ResultsFile | dict[str, Any]) -> str:
    """The JSON text of a results document, validated against the schema (a writer's bug fails here, loudly)."""
    data = as_dict(doc) if isinstance(doc, ResultsFile) else doc
    return _dumps(as_dict(ResultsFile.model_validate({"schema_version": SCHEMA_VERSION, **data})))


def decision_text(doc: Decision | dict[str, Any]) -> str:
    data = as_dict(doc) if isinstance(doc, Decision) else doc
    return _dumps(as_dict(Decision.model_validate({"schema_version": SCHEMA_VERSION, **data})))


def _dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=_jsonable) + "\n"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
