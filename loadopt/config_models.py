"""The config's pydantic models: every key a config file may hold, its type, default and range.
`loadopt.config` loads them from YAML with `--set` overrides and one-line errors (and re-exports them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def byte_size(value: Any) -> int:
    """A size given as a byte count or text (`500MB` = 500 x 10^6, `20GiB` = 20 x 2^30, `1.5 TB`) -> bytes;
    a ValueError saying what is expected otherwise (the config names the key)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    text = str(value).strip().lower() if isinstance(value, str) else ""
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text[len(number):].strip()
    try:
        amount = float(number) if number and unit in _SIZE_UNITS else -1.0
    except ValueError:
        amount = -1.0
    if not 1 <= amount * _SIZE_UNITS.get(unit, 0) < 2**63:  # also refuses nan and inf
        raise ValueError("expected a positive size such as 500MB, 20GiB or a byte count")
    return int(amount * _SIZE_UNITS[unit])


class SyntheticSpec(_Strict):
    """Parameters of the generated ImageNet-shaped dataset (used when `dataset.path` is null)."""

    num_samples: int = Field(4000, gt=0)
    num_classes: int = Field(100, gt=0)
    mean_width: int = Field(400, ge=16)
    mean_height: int = Field(350, ge=16)
    jpeg_quality: int = Field(90, ge=1, le=100)
    seed: int = 0
    # The val split's size as a fraction of num_samples (ImageNet's is 0.04), generated on first use.
    val_fraction: float = Field(0.1, ge=0, le=1)


class TokenSpec(_Strict):
    """The token corpus: generated when `dataset.path` is null, else the layout of the file there
    (a flat array of token ids, as nanoGPT's train.bin)."""

    num_tokens: int = Field(50_000_000, gt=1)
    vocab_size: int = Field(50257, gt=1)  # ids fit uint16 below 65,536, else uint32
    seed: int = 0

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"


class RecordSpec(_Strict):
    """Record workloads (DLIO / MLPerf Storage): generated when `dataset.path` is null,
    else the layout of the record files there. Sizes are per record; DLIO's names in the comments."""

    record_bytes: int = Field(150_528, gt=0)  # record_length_bytes (the mean)
    record_bytes_stdev: int = Field(0, ge=0)  # record_length_bytes_stdev
    samples_per_file: int = Field(1, gt=0)  # num_samples_per_file
    num_files: int = Field(64, gt=0)  # num_files_train
    # MLPerf Storage's published file count, where a config scales the file count down (`scale: published` uses it)
    published_num_files: int | None = Field(None, gt=0)
    file_format: Literal["raw", "npz"] = "npz"  # format (DLIO's tfrecord/hdf5 have no reader here)
    # record_length_bytes_resize: the bytes of each record delivered to the accelerator (its first bytes)
    delivered_bytes: int = Field(150_528, gt=0)
    # The published sizes times this (1: as published); workload.accelerator's step time is scaled alike,
    # so a scaled-down workload asks each accelerator for the published bytes per second. `published`:
    # scale 1 and `published_num_files` (MLPerf Storage's sizes, one key).
    scale: float = Field(1.0, gt=0, le=1)
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def published_sizes(cls, data: Any) -> Any:
        """`scale: published`: every size as MLPerf Storage publishes it (scale 1, `published_num_files`)."""
        if isinstance(data, dict) and data.get("scale") == "published":
            data = {**data, "scale": 1.0}
            if data.get("published_num_files") is not None:
                data["num_files"] = data["published_num_files"]
        return data


class ParquetColumns(_Strict):
    """The Parquet columns holding each sample's image (a `{bytes, path}` struct, as Hugging Face `datasets`
    writes it, or plain binary) and its label (an integer or a class name)."""

    image: str = "image"
    label: str = "label"


class DatasetConfig(_Strict):
    kind: Literal["images", "tokens", "records"] = "images"
    path: str | None = None
    # How `path` stores the images: `auto` tells an ImageFolder, WebDataset tar shards, Parquet files and a Hugging
    # Face `save_to_disk` folder apart by what the path holds.
    format: Literal["auto", "imagefolder", "webdataset", "parquet", "huggingface"] = "auto"
    # "package.module:function" returning the job's own dataset (a map-style torch Dataset, a Hugging Face
    # `datasets.Dataset`), or (dataset, version): read in place of `path`, the version naming its contents.
    factory: str | None = None
    label_key: str | None = None  # WebDataset: the `json` member's field holding the label (default: the `cls` member)
    columns: ParquetColumns = ParquetColumns()
    synthetic: SyntheticSpec = SyntheticSpec()
    tokens: TokenSpec = TokenSpec()
    records: RecordSpec = RecordSpec()
    on_error: Literal["raise", "skip"] = "raise"


class PipelineConfig(_Strict):
    batch_size: int = Field(64, gt=0)
    image_size: int = Field(224, ge=8)
    # train: RandomResizedCrop + flip; eval: resize + centre crop; none: loadopt crops nothing, `transform` does
    augment: Literal["train", "eval", "none"] = "train"
    # "package.module:function": the job's own per-sample transform, of the decoded image (a PIL image, or a HWC
    # uint8 array with `transform_input: array`) to `image_size` square uint8 pixels, run after loadopt's crop
    # (before any with `augment: none`) in each backend's workers, its random draws seeded per sample.
    transform: str | None = None
    transform_input: Literal["pil", "array"] = "pil"
    # true: the transform is `function(image, target) -> (image, target)`, the target `{"label": int, field: value}`
    # for the fields the batches carry (a detection job moves its boxes with its crop); what it returns is batched.
    transform_target: bool = False
    # The sample's fields besides its image and label that travel to the batch (a caption, a JSON target, a dict
    # item's keys, a Hugging Face dataset's columns), each batch then `(inputs, labels, fields)`; null: every field
    # the dataset's items have, [] none.
    fields: list[str] | None = None
    # The decoded forms' whole frames keep their longer side at most this (FFCV's max_resolution):
    # 512 keeps ImageNet-sized frames at their own pixels (docs/performance/recipe.md: storage per form).
    max_side: int = Field(512, ge=8)
    # The JPEG paths: `reduced` decodes a crop at least twice the output each way at a reduced DCT scale
    # (1/2-1/8: other pixels, far less work on large photos; docs/levers.md); `full`: scale 1.
    jpeg_scale: Literal["full", "reduced"] = "full"
    dtype: Literal["float32", "uint8"] = "float32"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    # global: one permutation of every sample per epoch; window: shards permuted, samples shuffled within a window
    # of `window_shards` shards, each rank reading its own shards; none: in order.
    # true and false are global and none.
    shuffle: Literal["global", "window", "none"] = "global"
    window_shards: int = Field(16, ge=1)
    # a source without files of many samples (an ImageFolder, tokens) is cut into shards of this many
    shard_samples: int = Field(1024, ge=1)
    # `shared`: batches in the sampler's order, as DataLoader's (every loadopt backend); `any` also lets `auto`
    # pick a backend whose library orders the samples itself (the peers, dali reader native): loadopt.recipe.
    order: Literal["shared", "any"] = "shared"
    drop_last: bool = False
    # Image batches in memory: channels_last (NCHW shape over NHWC memory: what pre-decoded backends hold and
    # convolutions prefer) or contiguous (NCHW memory, as DataLoader's default_collate gives); cost: docs/performance.
    memory_format: Literal["channels_last", "contiguous"] = "channels_last"
    seq_len: int = Field(1024, gt=0)  # tokens: each sample is seq_len + 1 tokens (inputs, shifted targets)

    @field_validator("shuffle", mode="before")
    @classmethod
    def _shuffle_from_bool(cls, value: object) -> object:
        return {True: "global", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("transform")
    @classmethod
    def _transform_named(cls, value: str | None) -> str | None:
        if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
            raise ValueError(f"{value!r} is not of the form 'package.module:function'")
        return value

    @model_validator(mode="after")
    def _augment_none_has_a_transform(self) -> PipelineConfig:
        if self.augment == "none" and self.transform is None:
            raise ValueError("augment: none leaves the crop to pipeline.transform, which is not set")
        if self.transform_target and self.transform is None:
            raise ValueError("transform_target: true hands pipeline.transform the target, and no transform is set")
        return self


class ServeConfig(_Strict):
    """The inference scenarios' settings (`workload.scenario` offline, server or single_stream), in the
    terms of MLPerf Inference's LoadGen and Triton's dynamic batcher (docs/serving.md)."""

    # server: the mean rate of the open-loop Poisson arrivals, requests per second
    target_qps: float = Field(200.0, gt=0)
    # server: a file of arrival times instead (seconds from the start, one per line, non-decreasing)
    arrivals: str | None = None
    requests: int = Field(2000, gt=0)  # server and single_stream: requests per run (the dataset's samples in turn)
    # server: a run's requests also stop at this many seconds of arrivals (but never fewer than 200): a low rate
    # tried by the search takes seconds, not minutes
    run_seconds: float = Field(10.0, gt=0)
    # the dynamic batcher: at most max_batch requests per step, the oldest waiting at most max_queue_delay_ms
    max_batch: int = Field(8, ge=1)
    max_queue_delay_ms: float = Field(2.0, ge=0)
    # the emulated accelerator's step for n requests: workload.step_time_ms + per_sample_ms x n
    per_sample_ms: float = Field(0.0, ge=0)
    workers: int | None = Field(None, ge=1)  # threads preprocessing requests (null: the usable cores)
    # server: search the highest rate whose p99 latency stays within this bound (LoadGen's server mode)
    slo_ms: float | None = Field(None, gt=0)
    search_runs: int = Field(7, ge=2)  # runs of the rate search, the first at target_qps
    seed: int = 0  # the arrivals' random draws


class WorkloadConfig(_Strict):
    # train: the training loop; offline, server, single_stream: MLPerf Inference LoadGen's scenarios (serve)
    scenario: Literal["train", "offline", "server", "single_stream"] = "train"
    serve: ServeConfig = ServeConfig()
    step_time_ms: float = Field(25.0, ge=0)
    warmup_batches: int = Field(5, ge=0)
    measure_batches: int = Field(200, gt=0)
    repeats: int = Field(3, ge=1)
    # "none": the emulated accelerator (a step of step_time_ms per batch); otherwise a real
    # forward+backward of this model on every batch.
    model: Literal["none", "small_cnn", "resnet50"] = "none"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # An alternative to step_time_ms: the emulated step of this accelerator from MLPerf Storage's
    # published figures (`loadopt.accelerators_table`), scaled to pipeline.batch_size.
    accelerator: str | None = None

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, value: str | None) -> str | None:
        from loadopt.accelerators_table import published_step

        return None if value is None else published_step(value).accelerator + "-" + published_step(value).model


class StorageConfig(_Strict):
    # "local", a profile name from configs/tiers.yaml, or an inline tier (`TierSpec`)
    tier: str | dict[str, Any] = "local"

    @field_validator("tier", mode="before")
    @classmethod
    def _tier_shape(cls, value: Any) -> Any:
        if not isinstance(value, (str, dict)):
            raise ValueError("expected local, a profile name from configs/tiers.yaml or a mapping of tier settings")
        return value
    cache: Literal["warm", "cold"] = "warm"
    # Where conversions (Arrow files, raw shards) of a dataset that is not on the local disk live: a
    # path or URL on the dataset's storage; null: beside the source under `.loadopt/` (on the local
    # disk: the cache).
    converted: str | None = None
    # A bounded local cache of a remote dataset's files: its most bytes, as
    # `20GiB`, `500MB` or a byte count; null: no cache, every read goes to the storage.
    cache_limit: int | None = None
    # Range requests of that cache in flight (a file's 1-8 MiB ranges, the files in the order they are read):
    # an object store limits each connection, so more at once is more of its bandwidth, and the first file
    # comes in at the link's rate (on a link that one request fills, no loss).
    cache_fetches: int = Field(8, ge=1)

    @field_validator("cache_limit", mode="before")
    @classmethod
    def _cache_limit_size(cls, value: Any) -> Any:
        return None if value is None else byte_size(value)


class ReportConfig(_Strict):
    out: str = "results/default"


class Config(_Strict):
    name: str = "default"
    seed: int = 0
    dataset: DatasetConfig = DatasetConfig()
    pipeline: PipelineConfig = PipelineConfig()
    workload: WorkloadConfig = WorkloadConfig()
    # backend name -> raw settings; validated against the backend's own model by `backend_settings`.
    loaders: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"torch": dict[str, Any]()})
    storage: StorageConfig = StorageConfig()
    report: ReportConfig = ReportConfig()
    # Where the config came from, for error messages and results; not a YAML key.
    source: str = Field("<defaults>", exclude=True)

    @model_validator(mode="after")
    def _accelerator_step_time(self) -> Config:
        """`workload.accelerator` sets `workload.step_time_ms` (every reader of it sees the same step)."""
        if self.workload.accelerator is not None:
            from loadopt.accelerators_table import published_step

            step_ms = published_step(self.workload.accelerator).step_time_ms(self.pipeline.batch_size)
            if self.dataset.kind == "records":  # records scaled down: the same bytes per second per accelerator
                step_ms *= self.dataset.records.scale
            if self.workload.step_time_ms != step_ms:  # (assigning re-runs this validator: stop when set)
                self.workload = self.workload.model_copy(update={"step_time_ms": step_ms})
        return self
