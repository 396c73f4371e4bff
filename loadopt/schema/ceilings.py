"""The bottleneck attribution's sections of results.json, as pydantic models: the machine's `ceilings`,
each run's `ceiling`, the `verdicts`, and the `stages` measured apart.

A bottom-layer module (pydantic and typing only), so that the results schema (fields of `ResultsFile`
and `Run`) and the report can read them. Each model is written with `written(model)` (or as
part of the results file, `schema.as_dict`, which dumps the same way): exactly the keys its producer set
(a measurement that was skipped is `{"skipped": why}` alone), in the order they are declared here; readers
get the defaults (None, or an empty part) for what a file does not say. Unknown keys are kept
(`extra="allow"`), as in the results schema, so no recorded figure is dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")


def written(section: BaseModel) -> dict[str, Any]:
    """The JSON-shaped section as results.json holds it: the keys that were set, no defaults added."""
    return section.model_dump(exclude_unset=True)


# -- the machine's ceilings ---------------------------------------------------------------------------


class BeforeAfter(_Section):
    """A ceiling measured before the runs and again after them (`keep_best` keeps the higher)."""

    before: float | None = None
    after: float | None = None


class Measurement(_Section):
    """One ceiling, or why it could not be measured (`skipped`: then the only key written)."""

    skipped: str | None = None


class Bandwidth(Measurement):
    """A byte rate: the memory copy (`memcpy`) or the pinned host-to-device link (`h2d`)."""

    name: str | None = None
    bytes_per_s: float | None = None
    measured: BeforeAfter | None = None


class StorageRead(Measurement):
    """The storage's read rate: local files read sequentially (page cache evicted first), or remote objects."""

    name: str | None = None
    bytes_per_s: float | None = None
    bytes: int | None = None
    note: str | None = None
    measured: BeforeAfter | None = None


class DecodeRate(Measurement):
    """Decode + crop/resize/flip of one decoder from memory, over the cores."""

    decoder: str | None = None
    resize: str | None = None
    per_core: float | None = None
    samples_per_s: float | None = None
    how: str | None = None
    measured: BeforeAfter | None = None


class DecodeRates(Measurement):
    """The decode ceilings: PIL (`pil`), the fastest decoder (`fast`), the stored JPEGs with restart
    markers (`stored`) and DALI's CPU engine (`dali`, when the bench runs dali)."""

    cores: int | None = None
    workers: int | None = None
    pil: DecodeRate | None = None
    fast: DecodeRate | None = None
    stored: DecodeRate | None = None
    dali: DecodeRate | None = None

    def rate(self, key: str) -> DecodeRate:
        """The decoder measured under `key` (pil, fast, stored, dali); an empty one where it was not."""
        return getattr(self, key, None) or DecodeRate()


DECODERS = ("pil", "fast", "stored", "dali")  # the keys of `DecodeRates`' decoders, in the order written


class CropResizeRate(Measurement):
    """Crop + resize of stored whole frames (the decoded forms' train path), from memory, over the cores."""

    name: str | None = None
    samples_per_s: float | None = None
    workers: int | None = None
    cores: int | None = None
    frames: int | None = None
    mean_frame_pixels: float | None = None
    max_side: int | None = None
    image_size: int | None = None
    augment: str | None = None
    how: str | None = None
    primitive: str | None = None
    measured: BeforeAfter | None = None


class ComputeAlone(Measurement):
    """The accelerator's step on an in-memory batch: what the job does with no loader."""

    name: str | None = None
    step_ms: float | None = None
    samples_per_s: float | None = None


class Job(_Section):
    """The job the runs are held against: its demand (batch_size / step time) and what it reads."""

    batch_size: int | None = None
    step_ms: float | None = None
    model: str | None = None
    cache: str | None = None  # warm | cold (storage.cache)
    demand_samples_per_s: float | None = None  # None: step time 0, as fast as possible
    augment: str | None = None
    max_side: int | None = None
    mean_sample_bytes: float | None = None
    kind: str | None = None  # images | tokens | records
    device: str | None = None  # the device's type: cpu | cuda
    ranks: int | None = None  # under torchrun: the demand is every rank's accelerator


class Ceilings(_Section):
    """results.json `ceilings`: the machine's ceilings measured in the bench's own run, and the job."""

    memcpy: Bandwidth = Field(default_factory=Bandwidth)
    storage: StorageRead = Field(default_factory=StorageRead)
    decode: DecodeRates = Field(default_factory=DecodeRates)
    crop_resize: CropResizeRate = Field(default_factory=CropResizeRate)
    h2d: Bandwidth = Field(default_factory=Bandwidth)
    compute: ComputeAlone = Field(default_factory=ComputeAlone)
    job: Job = Field(default_factory=Job)
    seconds: float | None = None  # spent measuring them
    kept: str | None = None  # which of the measurements before and after the runs is kept


# -- what each run is held to, and the verdicts --------------------------------------------------------


class RunCeiling(_Section):
    """A run's `ceiling`: the capacity of the stage that bounds it; marked unreliable (with the reason)
    when the run beat it by more than 10% (it was measured low)."""

    name: str
    samples_per_s: float | None = None
    unreliable: bool | None = None
    measured_fraction: float | None = None
    reason: str | None = None


class Verdict(_Section):
    """One of results.json `verdicts`: what bounds a backend's best setting, in one sentence; `by` says
    when the stages measured apart gave it rather than the ceilings."""

    label: str
    bottleneck: str
    text: str
    by: str | None = None


# -- the stages measured apart -------------------------------------------------------------------------


class ComputeStage(_Section):
    samples_per_s: float | None = None


class StorageStage(Measurement):
    """The loader's own files read alone (page cache evicted first), and that rate in its samples."""

    name: str | None = None
    bytes_per_s: float | None = None
    bytes: int | None = None
    note: str | None = None
    samples_per_s: float | None = None
    bytes_per_sample: float | None = None


class PrepStage(_Section):
    """Decode + transform from memory: the ceiling of what the setting does (`kind`: its stage)."""

    name: str = ""
    kind: str
    samples_per_s: float | None = None
    words: str
    lift: str


class LoaderRun(_Section):
    """A short run of the loader, warm (its files read into the page cache first) or cold (evicted)."""

    samples_per_s: float
    stall_fraction: float
    note: str = ""
    loader_stall_fraction: float | None = None
    finish_stall_fraction: float | None = None
    bytes_read_per_sample: float | None = None
    wait_ms: float
    finish_ms: float


class Stages(_Section):
    compute: ComputeStage
    storage: StorageStage
    prep: PrepStage
    loader_warm: LoaderRun
    loader_cold: LoaderRun


class StageMeasurement(_Section):
    """One of results.json `stages`: a backend's best setting measured stage by stage, and the verdict."""

    label: str
    stages: Stages
    bottleneck: str
    text: str
