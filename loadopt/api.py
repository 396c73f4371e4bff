"""`make_loader`: a drop-in for `torch.utils.data.DataLoader` in training code."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from loadopt.config import Config, PipelineConfig, config_from_dict, expand_settings, load_config
from loadopt.device import resolve_device
from loadopt.errors import BackendUnavailable, ConfigError, DatasetError
from loadopt.loaders.base import Loader, backend_class, backend_for, backend_names
from loadopt.storage.imagefolder import ImageDataset, open_dataset

log = logging.getLogger(__name__)

# `auto` without a recorded decision: the first available of these (fastest first, by design:
# native engines, then pre-packed formats, then the DataLoader everyone has).
FALLBACK_ORDER = ("dali", "arrow", "kvikio", "posix", "torch")


def _as_config(config_or_path: str | os.PathLike[str] | Config | dict[str, Any]) -> Config:
    if isinstance(config_or_path, dict):
        return config_from_dict(config_or_path, "<dict>")
    return load_config(config_or_path)


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _choose(config: Config, dataset: ImageDataset) -> tuple[str, dict[str, Any], str]:
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
    return found["backend"], found.get("settings") or {}, reason


def make_loader(config_or_path: str | os.PathLike[str] | Config | dict[str, Any], split: str = "train",
                backend: str = "auto", *, device: str | torch.device | None = None, rank: int | None = None,
                world_size: int | None = None, seed: int | None = None, epoch: int = 0,
                **overrides: Any) -> Loader:
    """A loader for `split` of the configured dataset, iterating `(inputs, labels)` on `device`.

    `backend="auto"` uses the setting the last `loadopt bench` found fastest for this dataset on this
    machine, else the first backend of `FALLBACK_ORDER` that is available and can read the dataset
    as it is (without a decision, `auto` starts no format conversion). Keyword overrides name pipeline
    keys (`batch_size=32`) or the backend's settings (`num_workers=4`) and always win. Under
    `torchrun` rank and world size come from `torch.distributed`. Where the config sweeps a knob
    (a list), the first value is used.
    """
    config = _as_config(config_or_path)
    dataset = open_dataset(config, split)
    if backend != "auto":
        return _build(config, dataset, backend, dict(config.loaders.get(backend) or {}), "asked for by name",
                      overrides, device, rank, world_size, seed, epoch, convert=True)
    chosen, settings_raw, why = _choose(config, dataset)
    if chosen:
        return _build(config, dataset, chosen, settings_raw, why, overrides, device, rank, world_size, seed, epoch,
                      convert=True)
    # No decision: the first available backend of the fixed order that is ready to read this dataset.
    # `auto` never starts a conversion on its own (a decoded ImageNet is ~250 GB): that takes a bench
    # decision, `loadopt convert`, or asking for the backend by name.
    for name in FALLBACK_ORDER:
        if name not in backend_names() or not backend_class(name).available()[0]:
            continue
        try:
            return _build(config, dataset, name, dict(config.loaders.get(name) or {}),
                          f"{why}; first ready in the fallback order {', '.join(FALLBACK_ORDER)}", overrides, device,
                          rank, world_size, seed, epoch, convert=False)
        except DatasetError as exc:
            log.info("make_loader: skipping %s: %s", name, exc)
    raise BackendUnavailable("make_loader: no backend is available here (see `loadopt doctor`)")


def _build(config: Config, dataset, backend: str, settings_raw: dict[str, Any], why: str, overrides: dict[str, Any],
           device, rank: int | None, world_size: int | None, seed: int | None, epoch: int, convert: bool) -> Loader:
    cls = backend_for(backend, f"make_loader: backend={backend!r}")
    available, reason = cls.available()
    if not available:
        raise BackendUnavailable(f"backend {backend}: {reason}")
    pipeline_raw = config.pipeline.model_dump()
    for key, value in overrides.items():
        if key in PipelineConfig.model_fields:
            pipeline_raw[key] = value
        elif key in cls.Settings.model_fields:
            settings_raw[key] = value
        else:
            raise ConfigError(f"make_loader: unknown keyword {key!r} (pipeline keys: "
                              f"{', '.join(PipelineConfig.model_fields)}; {backend} settings: "
                              f"{', '.join(cls.Settings.model_fields)})")
    pipeline = config_from_dict({"pipeline": pipeline_raw}, "make_loader").pipeline
    settings = expand_settings(cls.Settings, settings_raw, f"loaders.{backend}", "make_loader")[0]
    dist_rank, dist_world = _distributed()
    loader = cls(dataset, pipeline, settings, device=resolve_device(device or config.workload.device),
                 rank=dist_rank if rank is None else rank, world_size=dist_world if world_size is None else world_size,
                 seed=config.seed if seed is None else seed, epoch=epoch, on_error=config.dataset.on_error)
    loader.prepare(convert_missing=convert)  # e.g. converts the dataset to the backend's format on first use
    log.info("make_loader: backend %s (%s): %s", backend, loader.describe(), why)
    return loader
