"""CUDA paths: run where a GPU exists, skipped with the reason elsewhere (see conftest)."""

import time

import pytest
import torch

from loadopt.bench.accelerator import EmulatedAccelerator
from loadopt.bench.harness import run_repeat
from loadopt.config import PipelineConfig
from loadopt.device import DeviceTransfer
from loadopt.loaders.torch_dl.loader import TorchLoader, TorchSettings
from loadopt.storage.sources.imagefolder import scan_image_folder

from .conftest import make_image_folder

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_transfer_from_pinned_memory_is_timed_with_events():
    host = torch.empty((64, 3, 224, 224), dtype=torch.uint8).pin_memory()
    (moved,) = DeviceTransfer(CUDA).to_device(host)
    transfer = DeviceTransfer(CUDA)
    (moved,) = transfer.to_device(host)
    assert moved.device.type == "cuda"
    assert transfer.last.pinned and transfer.last.nbytes == host.numel()
    seconds = transfer.last.elapsed.seconds()
    assert 0 < seconds < 0.1
    assert host.numel() / seconds > 1e9  # pinned H2D is well above 1 GB/s on any PCIe or NVLink GPU


def test_emulated_accelerator_busy_kernel_keeps_the_host_free():
    accelerator = EmulatedAccelerator(0.010, CUDA)
    x = torch.zeros(1, device=CUDA)
    start = time.perf_counter()
    timings = [accelerator.step(x, x) for _ in range(10)]
    launched = time.perf_counter() - start
    accelerator.drain()
    device_time = sum(t.seconds() for t in timings)
    assert device_time == pytest.approx(0.100, rel=0.10)
    assert launched < 0.08  # the host ran ahead of the device (bounded queue of two steps)


def test_tuned_loader_on_cuda_uses_a_pinned_ring_and_delivers_on_device(tmp_path):
    make_image_folder(tmp_path, classes=3, per_class=8)
    dataset = scan_image_folder(str(tmp_path))
    pipeline = PipelineConfig(batch_size=8, image_size=32, augment="eval")
    settings = TorchSettings(variant="tuned", num_workers=2, pin_memory=True)
    on_gpu = TorchLoader(dataset, pipeline, settings, device=CUDA)
    on_cpu = TorchLoader(dataset, pipeline, settings, device="cpu")
    batches = list(on_gpu.host_batches())
    assert all(b.inputs.is_pinned() for b in batches)
    for (xg, yg), (xc, yc) in zip(on_gpu, on_cpu, strict=True):
        assert xg.device.type == "cuda" and xg.dtype == torch.float32
        assert torch.equal(yg.cpu(), yc) and torch.allclose(xg.cpu(), xc, atol=1e-5)


def test_harness_on_cuda_reports_pinned_h2d_and_device_idle(tmp_path):
    make_image_folder(tmp_path, classes=2, per_class=16)
    loader = TorchLoader(scan_image_folder(str(tmp_path)), PipelineConfig(batch_size=8, image_size=32),
                         TorchSettings(variant="tuned", num_workers=2), device=CUDA)
    result = run_repeat(loader, EmulatedAccelerator(0.002, CUDA), DeviceTransfer(CUDA), 2, 6)
    m = result.metrics
    assert m["h2d_pinned"] is True and not m["h2d_emulated"]
    assert m["h2d_gb_per_s"] > 0 and 0 <= m["device_idle_fraction"] <= 1
