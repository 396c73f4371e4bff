"""The consumer's step: an emulated accelerator (as MLPerf Storage and DLIO do) or a real model.

Emulated, on CUDA: a device-side busy kernel (`torch.cuda._sleep`) of the step time, so the host is
free to fetch the next batch, exactly as with a real model. On the CPU the emulated accelerator is a
clock (`EmulatedAccelerator.launch`): a step launched by the host starts when its batch is finished on
the emulated device's stream and the step before has ended, and lasts the step time; as with the CUDA
kernel nothing runs and the host goes on at once, held at most `AHEAD` steps ahead (the harness sleeps
until then, which releases the GIL for the loader's threads). A step returns the compute time it took,
either as seconds or, on CUDA, as an event pair read back later (never a synchronisation per step).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from loadopt.device import Elapsed

# Steps the host may launch ahead of the device, as a training loop's optimiser step and loss read-back
# allow; an unbounded queue would hide stalls in the backlog.
AHEAD = 2


class Accelerator:
    """Runs one step per batch (`_work`), timed on the host clock or with CUDA events; `drain()`
    waits for outstanding device work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: deque[torch.cuda.Event] = deque()

    def _work(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> Elapsed:
        if self.device.type != "cuda":
            began = time.perf_counter()
            self._work(inputs, labels)
            return Elapsed(time.perf_counter() - began)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._work(inputs, labels)
        end.record()
        _bound_queue(self._pending, end)
        return Elapsed(events=(start, end))

    def drain(self) -> None:
        """Wait for every step launched so far (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class EmulatedAccelerator(Accelerator):
    def __init__(self, step_time_s: float, device: torch.device) -> None:
        super().__init__(device)
        self.step_time_s = step_time_s
        self._cycles_per_s = calibrate_sleep(device) if device.type == "cuda" else 0.0
        self._busy_until = 0.0  # the CPU clock's: when the last step launched ends (host clock)

    @property
    def clocked(self) -> bool:
        """True on the CPU, where steps are launched on the clock (`launch`) rather than run."""
        return self.device.type != "cuda"

    def launch(self, ready_s: float) -> tuple[float, float]:
        """Launch a step whose batch is ready on the device at `ready_s` (host clock): its (start, end),
        the start no earlier than the previous step's end. Nothing waits here (see the module)."""
        start = max(ready_s, self._busy_until)
        self._busy_until = start + max(0.0, self.step_time_s)
        return start, self._busy_until

    def _work(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        if self.step_time_s <= 0:
            return
        if self.device.type == "cuda":
            torch.cuda._sleep(int(self.step_time_s * self._cycles_per_s))
        else:
            time.sleep(self.step_time_s)


def _bound_queue(pending: deque, event: torch.cuda.Event, depth: int = AHEAD) -> None:
    """Let the host run at most `depth` steps ahead of the device, as a training loop's optimiser
    step and loss read-back would; an unbounded queue would hide stalls in the backlog."""
    pending.append(event)
    while len(pending) > depth:
        pending.popleft().synchronize()


def calibrate_sleep(device: torch.device) -> float:
    """Clock cycles per second of `torch.cuda._sleep` on this GPU, measured with events."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000)  # warm up the kernel
        cycles = 50_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1000.0)


class SmallCNN(torch.nn.Module):
    """loadopt's own stand-in model for a real step without torchvision."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        channels = 3
        for width in (32, 64, 128):
            layers += [torch.nn.Conv2d(channels, width, 3, stride=2, padding=1), torch.nn.BatchNorm2d(width),
                       torch.nn.ReLU(inplace=True)]
            channels = width
        self.features = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ModelStep(Accelerator):
    """A real forward + backward + SGD step of `model_name` on each batch."""

    def __init__(self, model_name: str, num_classes: int, device: torch.device) -> None:
        from loadopt.errors import BackendUnavailable

        if model_name == "resnet50":
            try:
                import torchvision
            except Exception as exc:  # noqa: BLE001 - torchvision fails to import in several ways
                raise BackendUnavailable(f"workload.model: resnet50 needs torchvision, which does not import "
                                         f"here ({type(exc).__name__}: {exc}); use small_cnn") from None
            model = torchvision.models.resnet50(num_classes=num_classes)
        else:
            model = SmallCNN(num_classes)
        super().__init__(device)
        self.model = model.to(device).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def _work(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        if inputs.dtype == torch.uint8:
            inputs = inputs.float().div_(255.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(inputs), labels)
        loss.backward()
        self.optimizer.step()


def make_accelerator(model: str, step_time_ms: float, num_classes: int, device: torch.device) -> Accelerator:
    if model == "none":
        return EmulatedAccelerator(step_time_ms / 1000.0, device)
    return ModelStep(model, num_classes, device)
