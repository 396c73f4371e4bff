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
from loadopt.errors import ConfigError, DatasetError, describe_sample_error
from loadopt.loaders.registry import backend_for, configured_loader
from loadopt.loaders.serving import Payload, RequestPath, Unservable
from loadopt.schema.serve import ServeResults
from loadopt.serve.scenarios import best_path, inference_config
from loadopt.storage.open import open_dataset

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
        """The batch; a request that cannot be decoded is a `DatasetError` naming it (its place in the batch and
        its size) and what is wrong, on one line."""
        batch = list(requests) if isinstance(requests, (list, tuple)) else [requests]
        try:
            images = self.path.batch(batch) if self.path.per_batch else torch.stack([self.path.one(p) for p in batch])
        except Exception as exc:  # noqa: BLE001 - which request: each tried alone, the first failing one named
            raise self._culprit(batch, exc) from None
        moved = images if images.device == self.device else self._transfer.to_device(images)[0]
        return finish_inputs(moved, "NHWC", False, self.path.pipeline)

    def close(self) -> None:
        self.path.close()

    def _culprit(self, batch: list[Payload], failure: Exception) -> DatasetError:
        for index, payload in enumerate(batch):
            try:
                self.path.one(payload)
            except Exception as exc:  # noqa: BLE001 - this request is the one named
                return DatasetError(f"{_request_name(index, batch, payload)}: {_request_problem(payload, exc)}")
        return DatasetError(f"a batch of {len(batch)} requests: {describe_sample_error(failure)}")


def _request_name(index: int, batch: list[Payload], payload: Payload) -> str:
    """Which request: its place in the call and its size (a request has no file name)."""
    size = len(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else None
    what = f"{size:,} bytes" if size is not None else type(payload).__name__
    return f"request {index + 1} of {len(batch)} ({what})"


def _request_problem(payload: Payload, exc: Exception) -> str:
    if isinstance(payload, (bytes, bytearray, memoryview)) and len(payload) == 0:
        return "empty: no image bytes"
    return describe_sample_error(exc)


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
