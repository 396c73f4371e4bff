"""`make_loader`: a drop-in for `torch.utils.data.DataLoader` in training code."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Collection
from typing import Any, TypedDict

import torch

from loadopt import recipe
from loadopt.bench.knobs import start_settings
from loadopt.config import config_from_dict, load_config
from loadopt.config_models import Config, PipelineConfig
from loadopt.device import resolve_device
from loadopt.errors import BackendUnavailable, ConfigError, DatasetError
from loadopt.loaders.base import BatchTransform, Loader
from loadopt.loaders.registry import BUILTINS, backend_class, backend_for, backend_names
from loadopt.loaders.ring import RingLoader
from loadopt.loaders.sample_transform import SampleTransform
from loadopt.named import name_of
from loadopt.progress import StderrProgress, quiet
from loadopt.recipe import RecipeMismatch
from loadopt.schema.documents import Knobs
from loadopt.storage.dataset import Dataset
from loadopt.storage.open import open_dataset
from loadopt.storage.sources.user import from_object

log = logging.getLogger(__name__)

# The job's own per-sample transform, as handed to `make_loader(transform=...)`: the decoded image -> the image.
SampleFunction = Callable[[Any], Any]

# `auto` without a recorded decision: the first available of these (fastest first, by design:
# native engines, then pre-packed formats, then the DataLoader everyone has).
FALLBACK_ORDER = ("dali", "arrow", "kvikio", "posix", "torch")


def _as_config(config_or_path: str | os.PathLike[str] | Config | dict[str, Any]) -> Config:
    if isinstance(config_or_path, dict):
        return config_from_dict(config_or_path, "<dict>")
    if isinstance(config_or_path, str | os.PathLike) and os.path.isdir(config_or_path):
        # a dataset's folder (an ImageFolder, shards, Parquet, a save_to_disk folder) with every other key's default
        return config_from_dict({"dataset": {"path": os.fspath(config_or_path)}}, os.fspath(config_or_path))
    return load_config(config_or_path)


def is_config(given: object) -> bool:
    """Whether `make_loader` was handed a config (a path, a `Config`, a dict) rather than a dataset object."""
    return isinstance(given, str | os.PathLike | Config | dict)


def _with_transform(config: Config, transform: SampleFunction | None) -> Config:
    """`config` whose `pipeline.transform` names `transform` (a copy: the caller's config is left as it was)."""
    if transform is None:
        return config
    if not callable(transform):
        raise ConfigError(f"make_loader: transform= must be a function of the decoded image, got "
                          f"{type(transform).__name__}")
    copied = config.model_copy(deep=True)
    copied.pipeline.transform = name_of(transform)
    return copied


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _choose(config: Config, dataset: Dataset) -> tuple[str, Knobs, str]:
    """(backend, settings, why) for `auto` from the recorded decision; backend "" when none applies.

    A decision applies when it was made for this dataset on this machine (CPU model and count, GPU
    model, storage tier); one measured here with other pipeline settings is used with a warning."""
    from loadopt.bench import decision

    tier = decision.storage_tier(config.storage.tier, dataset.root)
    found, match, why = decision.find(config.pipeline.model_dump(mode="json"), dataset.fingerprint, tier)
    if match in ("other machine", "other settings"):
        log.warning("make_loader: %s", why)
    if found is None:
        return "", {}, why
    margin = f", {found['margin']:.2f}x the runner-up" if found.get("margin") else ""
    reason = (f"fastest in the last bench on this machine ({found.get('samples_per_s', 0):,.0f} samples/s{margin}, "
              f"{found.get('created', '?')})")
    if found.get("passed_over_for_order"):  # peers and dali reader native: their library's order, not the sampler's
        reason += (f"; passed over for their library's own order ({decision.ORDER_OPT_IN}): "
                   f"{', '.join(found['passed_over_for_order'])}")
    return found["backend"], found.get("settings") or {}, reason


# A split other than train is evaluated: eval augmentation (resize + centre crop), in order, every sample.
EVAL_SPLIT_DEFAULTS: dict[str, str | bool] = {"augment": "eval", "shuffle": False, "drop_last": False}

# DataLoader keywords that have no place here, and what to use instead (one line each).
REFUSED_KEYWORDS = {
    "collate_fn": "batches are assembled by the backend; pass batch_transform=fn instead: fn(inputs, labels) -> "
                  "(inputs, labels) runs on each finished batch on the device (mixup/cutmix: "
                  "batch_transform=mixup_cutmix)",
    "sampler": "the sample order is loadopt's, the same on every backend: use shuffle= and seed= (ranks come from "
               "torch.distributed, each sample once per epoch across them) and call loader.set_epoch(epoch) where "
               "you called sampler.set_epoch(epoch)",
    "batch_sampler": "use batch_size=, drop_last= and shuffle= (the order is loadopt's, as for sampler=)",
    "generator": "use seed= (the order and the augmentation of every backend follow it)",
    "worker_init_fn": "the backend owns its workers (processes or threads); set the backend's settings instead",
}

# DataLoader's `num_workers` under the name each backend gives its parallelism (the first one it has).
PARALLELISM_KNOBS = ("num_workers", "num_threads", "threads")


def make_loader(config_or_path: str | os.PathLike[str] | Config | dict[str, Any] | Any, split: str = "train",
                backend: str = "auto", *, device: str | torch.device | None = None, rank: int | None = None,
                world_size: int | None = None, seed: int | None = None, epoch: int = 0,
                batch_transform: BatchTransform | None = None, transform: SampleFunction | None = None,
                relist: bool = False, **overrides: Any) -> Loader:
    """A loader for `split` of the configured dataset, iterating `(inputs, labels)` on `device`.

    In place of a config, the job's own dataset object (a map-style torch `Dataset` of `(image, target)` or dict
    items, a Hugging Face `datasets.Dataset`): read through its own `[i]`, with the config's defaults; or a
    dataset's folder (`dataset.path`, with the config's defaults).
    `transform(image) -> image` is the job's own per-sample transform (as `pipeline.transform`): run after
    loadopt's crop (`augment="none"`: in its place) in the backend's workers, Python's, NumPy's and torch's
    generators seeded from (seed, epoch, sample index) before each call, so every backend draws the same.
    `on_error="skip"` skips (and counts) a sample that cannot be read, decoded or transformed (`dataset.on_error`).

    `backend="auto"` uses the setting the last `loadopt bench` found fastest for this dataset on this
    machine, else the first backend of `FALLBACK_ORDER` that is available and can read the dataset
    as it is (without a decision, `auto` starts no format conversion). `auto` keeps the sampler's order, as
    DataLoader does: a backend whose library orders the samples itself (the peers, dali `reader: native`)
    is passed over, named in the reason, unless `pipeline.order: any` allows it. Keyword overrides name pipeline
    keys (`batch_size=32`) or the backend's settings and always win; DataLoader's `num_workers` and
    `pin_memory` are accepted by every backend (mapped to its own knobs, said in the log), its
    `collate_fn`/`sampler` refused with what to use instead. A split other than `train` defaults to
    `augment="eval", shuffle=False, drop_last=False`. Under `torchrun` rank and world size come from
    `torch.distributed`. Where the config sweeps a knob (a list), the backend's default for this machine
    is used when the list holds it (the tuner's start), else the list's first value; the log says which
    value each knob took and why. `batch_transform(inputs, labels) -> (inputs, labels)` runs on each
    finished batch on the device. `relist=True` lists the dataset again (as `--relist`: a remote dataset's
    listing is saved on its first open and reused).
    """
    for key in overrides:
        if key in REFUSED_KEYWORDS:
            raise ConfigError(f"make_loader: {key}= is not supported: {REFUSED_KEYWORDS[key]}")
    if batch_transform is not None and not callable(batch_transform):
        raise ConfigError(f"make_loader: batch_transform= must be a function of (inputs, labels), got "
                          f"{type(batch_transform).__name__}")
    config = _with_transform(_as_config(config_or_path) if is_config(config_or_path) else Config(source="make_loader"),
                             transform)
    if "on_error" in overrides:  # the dataset's policy, for a dataset object with no config to hold it
        config = config.model_copy(deep=True)
        config.dataset.on_error = overrides.pop("on_error")
    if transform is None:  # the config's transform imports, before any dataset is opened (or generated)
        SampleTransform.of_pipeline(config.pipeline)
    if is_config(config_or_path):
        dataset: Dataset = open_dataset(config, split, relist=relist,
                                        progress=StderrProgress("loadopt: generating the synthetic dataset"))
    else:  # the job's own dataset object, with the defaults of every other key
        dataset = from_object(config_or_path, config, split=split)
    overrides = {**_split_defaults(split, overrides), **overrides}
    build = _Placement(overrides=overrides, device=device, rank=rank, world_size=world_size, seed=seed, epoch=epoch,
                       transform=transform)
    if backend != "auto":
        loader = _build(config, dataset, backend, dict(config.loaders.get(backend) or {}), f"loaders.{backend}",
                        "asked for by name", build, convert=True)
    else:
        loader = _auto(config, dataset, build)
    loader.batch_transform = batch_transform
    return loader


def _split_defaults(split: str, given: Collection[str]) -> dict[str, str | bool]:
    """The defaults of a split other than train that the keywords `given` leave as they are."""
    if split == "train":
        return {}
    defaults = {k: v for k, v in EVAL_SPLIT_DEFAULTS.items() if k not in given}
    if defaults:
        log.info("make_loader: split %r: %s (a split other than train; pass %s to change)", split,
                 ", ".join(f"{k}={v}" for k, v in defaults.items()), "=, ".join(defaults) + "=")
    return defaults


class _Placement(TypedDict):
    """What `make_loader` was asked for beyond the backend: the same for whichever backend is built."""

    overrides: dict[str, Any]
    device: str | torch.device | None
    rank: int | None
    world_size: int | None
    seed: int | None
    epoch: int
    transform: SampleFunction | None  # the job's own per-sample transform, as given


def _auto(config: Config, dataset, build: _Placement) -> Loader:
    chosen, settings_raw, why = _choose(config, dataset)
    if chosen:  # never onto another training input (loadopt.recipe): then the fallback order below
        try:
            return _build(config, dataset, chosen, settings_raw, "the bench decision", why, build, convert=True,
                          same_recipe=True)
        except RecipeMismatch as exc:
            why = f"the bench decision is not used: {exc}"
            log.warning("make_loader: %s", why)
    # No decision: the first available backend of the fixed order that is ready to read this dataset.
    # `auto` never starts a conversion on its own (a decoded ImageNet is ~250 GB): that takes a bench
    # decision, `loadopt convert`, or asking for the backend by name.
    # Outside backends (entry points) come after the built-ins; a decision picks any backend that won a bench.
    outside = [name for name in backend_names() if name not in BUILTINS]
    for name in (*FALLBACK_ORDER, *outside):
        if name not in backend_names() or not backend_class(name).available()[0] \
                or not backend_class(name).supports(dataset)[0]:
            continue
        try:
            return _build(config, dataset, name, dict(config.loaders.get(name) or {}), f"loaders.{name}",
                          f"{why}; first ready in the fallback order {', '.join(FALLBACK_ORDER)}", build,
                          convert=False, same_recipe=True)
        except (DatasetError, BackendUnavailable) as exc:
            log.info("make_loader: skipping %s: %s", name, exc)
    raise BackendUnavailable("make_loader: no backend is available here (see `loadopt doctor`)")


def _dataloader_keywords(cls: type[Loader], backend: str, overrides: dict[str, Any]) -> tuple[dict[str, Any],
                                                                                             dict[str, str]]:
    """`num_workers` and `pin_memory` as this backend names them (or dropped, with the reason), and why."""
    out, why = dict(overrides), {}
    fields = cls.Settings.model_fields
    if "num_workers" in out and "num_workers" not in fields:
        workers = out.pop("num_workers")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ConfigError(f"make_loader: num_workers must be a whole number >= 0, got {workers!r}")
        knob = next((k for k in PARALLELISM_KNOBS if k in fields), None)
        if knob is None:
            log.info("make_loader: num_workers=%s ignored: %s has no parallelism knob", workers, backend)
        elif knob not in out:
            out[knob] = max(1, workers)
            why[knob] = f"num_workers={workers} passed to make_loader: {backend}'s threads in this process (at least 1)"
    if "pin_memory" in out and "pin_memory" not in fields:
        pin = out.pop("pin_memory")
        owns = "its batch ring is pinned whenever the device is CUDA" if issubclass(cls, RingLoader) else \
            "it allocates its own host buffers"
        log.info("make_loader: pin_memory=%s: %s has no such knob (%s)", pin, backend, owns)
    return out, why


def _build(config: Config, dataset, backend: str, settings_raw: Knobs, where: str, why: str,
           placement: _Placement, *, convert: bool, same_recipe: bool = False) -> Loader:
    cls = backend_for(backend, f"make_loader: backend={backend!r}")
    available, reason = cls.available()
    if not available:
        raise BackendUnavailable(f"backend {backend}: {reason}")
    overrides, knob_why = _dataloader_keywords(cls, backend, placement["overrides"])
    pipeline_raw = config.pipeline.model_dump()
    settings_raw = dict(settings_raw)
    for key, value in overrides.items():
        if key in PipelineConfig.model_fields:
            pipeline_raw[key] = value
        elif key in cls.Settings.model_fields:
            settings_raw[key] = value
            knob_why.setdefault(key, "passed to make_loader")
        else:
            raise ConfigError(f"make_loader: unknown keyword {key!r} (pipeline keys: "
                              f"{', '.join(PipelineConfig.model_fields)}; {backend} settings: "
                              f"{', '.join(cls.Settings.model_fields)}; batch_transform)")
    pipeline = config_from_dict({"pipeline": pipeline_raw}, "make_loader").pipeline
    settings, start_why = start_settings(cls, settings_raw, where, "make_loader")
    runs, why_not = cls.runs_pipeline(pipeline, settings)
    if not runs:
        raise BackendUnavailable(f"backend {backend}: {why_not}")
    knob_why = {**start_why, **knob_why}
    dist_rank, dist_world = _distributed()
    rank, world_size, seed = placement["rank"], placement["world_size"], placement["seed"]
    loader = cls(dataset, pipeline, settings, device=resolve_device(placement["device"] or config.workload.device),
                 rank=dist_rank if rank is None else rank, world_size=dist_world if world_size is None else world_size,
                 seed=config.seed if seed is None else seed, epoch=placement["epoch"], on_error=config.dataset.on_error)
    function = placement["transform"]
    if function is not None:  # the function itself, not imported again by its name
        loader.sample_transform = SampleTransform(function, name_of(function), pipeline.image_size,
                                                  pipeline.transform_input, pipeline.transform_target)
    if same_recipe:  # `auto`: only a loader that delivers the config's training input (before any conversion)
        recipe.check(loader, pipeline)
    # e.g. converts the dataset to the backend's format on first use
    loader.prepare(StderrProgress(f"loadopt: converting for {backend}"), convert_missing=convert)
    log.info("make_loader: backend %s (%s): %s", backend, loader.describe(), why)
    if loader.rank == 0 and not quiet():  # said once, by one rank: which path the job got (LOADOPT_QUIET=1: not)
        print(f"loadopt: make_loader took {backend} ({loader.describe()}): {why}", file=sys.stderr, flush=True)
    log.info("make_loader: %s knobs: %s", backend, _knobs_line(settings, knob_why))
    return loader


def _knobs_line(settings, why: dict[str, str]) -> str:
    """Each knob's value and why, knobs with a reason shared by several (a decision, the defaults) grouped."""
    groups: dict[str, list[str]] = {}
    for key, reason in why.items():
        groups.setdefault(reason, []).append(key)
    parts = []
    for reason, keys in groups.items():
        if reason == "the backend's default":
            parts.append(f"at the backend's defaults: {', '.join(keys)}")
        elif len(keys) > 1:
            parts.append(f"{reason}: " + ", ".join(f"{k}={getattr(settings, k)!r}" for k in keys))
        else:
            parts.append(f"{keys[0]}={getattr(settings, keys[0])!r} ({reason})")
    return "; ".join(sorted(parts, key=lambda part: part.startswith("at the backend's defaults")))


def make_preprocessor(config_or_path: str | os.PathLike[str] | Config | dict[str, Any], path: str = "auto",
                      device: str | torch.device | None = None):
    """A serving input path: a callable from request bytes (or a list of them) to the model's input batch on the
    device, with the eval recipe. `path` "auto": the best request path of the last `loadopt bench` in a serving
    scenario (serve.json in the config's report.out), else the config's first; or a path's label from that table."""
    from loadopt.serve.preprocessor import make_preprocessor as make

    return make(_as_config(config_or_path), path, device)
