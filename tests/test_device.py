"""Finishing batches on the device: NHWC uint8 batches normalised equal the NCHW path bit for bit."""

import pytest
import torch

from loadopt.config import PipelineConfig
from loadopt.device import DeviceTransfer, finish_inputs


@pytest.mark.parametrize("one_pass", [True, False])  # loadopt._native's normalise, or torch's two ops
@pytest.mark.parametrize("size", [32, 30])  # 32 x 32 takes the channels-last path, 30 x 30 (900 % 16) does not
def test_nhwc_normalisation_equals_the_nchw_path(size, one_pass, monkeypatch):
    from loadopt import device

    if one_pass and device.native is None:
        pytest.skip("loadopt._native is not built (no C compiler when loadopt was installed)")
    if not one_pass:
        monkeypatch.setattr(device, "native", None)
    pipeline = PipelineConfig(image_size=size)
    nhwc = torch.randint(0, 256, (5, size, size, 3), dtype=torch.uint8)
    nchw = nhwc.permute(0, 3, 1, 2).contiguous()
    expected = finish_inputs(nchw, "NCHW", False, pipeline)
    transfer = DeviceTransfer(torch.device("cpu"), emulate=True)
    for scratch in (None, transfer.scratch):
        got = finish_inputs(nhwc, "NHWC", False, pipeline, scratch)
        assert got.shape == (5, 3, size, size) and got.dtype == torch.float32
        assert torch.equal(got, expected)
    # the reference itself: (x / 255 - mean) / std per channel
    mean, std = torch.tensor(pipeline.mean).view(1, 3, 1, 1), torch.tensor(pipeline.std).view(1, 3, 1, 1)
    assert torch.allclose(expected, (nchw.float() / 255 - mean) / std, atol=1e-5)


def test_native_normalise_covers_every_element():
    """Lengths that leave a remainder after the 24-element steps, and an unaligned output."""
    from loadopt import device

    if device.native is None:
        pytest.skip("loadopt._native is not built (no C compiler when loadopt was installed)")
    scale, shift = torch.tensor([0.5, 2.0, -1.0]), torch.tensor([1.0, -3.0, 0.25])
    for count in (3, 27, 24 * 5 + 9):
        pixels = torch.randint(0, 256, (count,), dtype=torch.uint8)
        storage = torch.empty(count + 1)
        out = storage[1:]  # 4 bytes past the allocation's alignment: ordinary stores
        if not device.native.normalise(out.numpy(), pixels.numpy(), scale.tolist(), shift.tolist()):
            pytest.skip("this CPU has no AVX2 and FMA: the native normalise declines")
        expected = torch.addcmul(shift.repeat(count // 3), pixels.float(), scale.repeat(count // 3))
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="need 16 output bytes"):
        device.native.normalise(torch.empty(3).numpy(), torch.zeros(4, dtype=torch.uint8).numpy(), (1, 1, 1),
                                (0, 0, 0))


def test_the_emulated_stream_runs_its_work_in_order_beside_the_caller_and_hands_back_errors():
    import threading

    from loadopt.device import EmulatedStream

    stream = EmulatedStream()
    release = threading.Event()
    order: list[int] = []
    try:
        first = stream.submit(lambda: (release.wait(5), order.append(1), "one")[-1])
        second = stream.submit(lambda: order.append(2) or 1 / 0)
        assert not first.done.is_set()  # queued, not run by submit: the caller goes on
        order.append(0)
        release.set()
        assert first.wait() == "one"
        with pytest.raises(ZeroDivisionError):
            second.wait()
        assert order == [0, 1, 2]
        assert first.began_s <= first.ended_s <= second.began_s <= second.ended_s
    finally:
        stream.close()


def test_the_emulated_accelerator_clock_starts_a_step_when_its_batch_and_the_device_are_ready():
    from loadopt.bench.accelerator import EmulatedAccelerator

    accelerator = EmulatedAccelerator(0.025, torch.device("cpu"))
    assert accelerator.clocked
    assert accelerator.launch(10.0) == (10.0, 10.025)  # an idle device: at once
    assert accelerator.launch(10.005) == (10.025, 10.05)  # ready early: after the step before
    start, end = accelerator.launch(10.1)  # ready late: the device waited 0.05 s
    assert start == 10.1 and end == pytest.approx(10.125)
