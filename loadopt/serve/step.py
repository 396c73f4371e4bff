"""The accelerator behind the server: a step per dynamic batch whose time grows with the batch
(`step_time_ms + per_sample_ms x n`, emulated as the training harness's accelerator is), or a real model's
forward pass. On a GPU the emulated step is a device-side busy kernel and the step ends when it has run."""

from __future__ import annotations

import time

import torch

from loadopt.bench.accelerator import SmallCNN, calibrate_sleep
from loadopt.config_models import WorkloadConfig
from loadopt.errors import BackendUnavailable


class ServingStep:
    """Runs one batch's step and returns when its result would be back on the host."""

    def __init__(self, workload: WorkloadConfig, num_classes: int, device: torch.device) -> None:
        self.device = device
        self.fixed_s = workload.step_time_ms / 1000.0
        self.per_sample_s = workload.serve.per_sample_ms / 1000.0
        self.model_name = workload.model
        self.model: torch.nn.Module | None = None
        if workload.model != "none":
            self.model = _inference_model(workload.model, num_classes).to(device).eval()
        self._cycles_per_s = calibrate_sleep(device) if device.type == "cuda" and self.model is None else 0.0

    def describe(self) -> str:
        if self.model is not None:
            return f"{self.model_name} forward pass (no gradients) on {self.device.type}"
        return f"emulated: {self.fixed_s * 1e3:g} ms + {self.per_sample_s * 1e3:g} ms x n per batch of n"

    def seconds(self, n: int) -> float:
        """The emulated step's time for a batch of `n`."""
        return self.fixed_s + self.per_sample_s * n

    def run(self, inputs: torch.Tensor) -> None:
        n = int(inputs.shape[0])
        if self.model is not None:
            with torch.inference_mode():
                self.model(inputs if inputs.is_floating_point() else inputs.float().div_(255.0))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return
        seconds = self.seconds(n)
        if seconds <= 0:
            return
        if self.device.type == "cuda":
            torch.cuda._sleep(int(seconds * self._cycles_per_s))
            torch.cuda.synchronize(self.device)
        else:
            time.sleep(seconds)


def _inference_model(name: str, num_classes: int) -> torch.nn.Module:
    if name == "resnet50":
        try:
            import torchvision
        except Exception as exc:  # noqa: BLE001 - torchvision fails to import in several ways
            raise BackendUnavailable(f"workload.model: resnet50 needs torchvision, which does not import here "
                                     f"({type(exc).__name__}: {exc}); use small_cnn") from None
        return torchvision.models.resnet50(num_classes=num_classes)
    return SmallCNN(num_classes)
