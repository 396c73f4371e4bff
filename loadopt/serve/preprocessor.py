"""`make_preprocessor`: the request path a serve bench found best, handed to serving code as a callable from
request bytes (one request, or a list: a batch) to the model's input on the device, finished as the bench's
(the eval recipe, layout and normalisation)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from loadopt.config import backend_settings
from loadopt.config_models import Config
from loadopt.device import DeviceTransfer, finish_inputs, resolve_device
from loadopt.errors import ConfigError
from loadopt.loaders.registry import backend_for, configured_loader
from loadopt.loaders.serving import Payload, RequestPath, Unservable
from loadopt.schema_serve import ServeResults
from loadopt.serve.bench import best_path, inference_config
from loadopt.storage.imagefolder import open_dataset

DEFAULT_BACKEND = "torch"  # a config naming no loader: torch's request paths


class Preprocessor:
    """Request bytes (or a list of them) to a batch on the device: (n, 3, size, size) in the pipeline's dtype
    and memory format. `label` names the request path."""

    def __init__(self, path: RequestPath, device: torch.device, why: str) -> None:
        self.path = path
        self.label = path.label
        self.why = why
        self.device = device
        self._transfer = DeviceTransfer(device, emulate=False)

    def __call__(self, requests: Payload | Sequence[Payload]) -> torch.Tensor:
        batch = list(requests) if isinstance(requests, (list, tuple)) else [requests]
        images = self.path.batch(batch) if self.path.per_batch else torch.stack([self.path.one(p) for p in batch])
        moved = images if images.device == self.device else self._transfer.to_device(images)[0]
        return finish_inputs(moved, "NHWC", False, self.path.pipeline)

    def close(self) -> None:
        self.path.close()


def make_preprocessor(config: Config, path: str = "auto", device: str | torch.device | None = None) -> Preprocessor:
    """The request path named `path` (a label of serve.json's rows, e.g. "torch tuned region"), or with "auto" the
    best one of the last serving bench in `config.report.out` (else the config's first request path)."""
    resolved = resolve_device(device if device is not None else config.workload.device)
    label, why = _choose(config, path)
    eval_config = inference_config(config)
    dataset = open_dataset(eval_config)
    for name in list(config.loaders) or [DEFAULT_BACKEND]:
        if not backend_for(name, f"loaders.{name}").available()[0]:
            continue
        for settings in backend_settings(eval_config, name):
            loader = configured_loader(name, eval_config, dataset, settings, device=resolved)
            try:
                paths = loader.request_paths(config.workload.serve.max_batch)
            except Unservable:
                paths = []
            chosen = next((candidate for candidate in paths if label is None or candidate.label == label), None)
            if chosen is None:
                loader.close()
                continue
            chosen.open(dataset)
            return Preprocessor(chosen, resolved, why)
    raise ConfigError(f"make_preprocessor: no request path {label!r} among the config's loaders "
                      f"({', '.join(config.loaders)})")


def _choose(config: Config, path: str) -> tuple[str | None, str]:
    if path != "auto":
        return path, "asked for"
    results = Path(config.report.out).expanduser() / "serve.json"
    if results.exists():
        document = ServeResults.model_validate(json.loads(results.read_text()))
        best = best_path(document)
        if best is not None:
            return best.label, f"best in {results} ({document.scenario})"
    return None, "no serve bench in report.out: the config's first request path"
