"""Finishing batches on the device: NHWC uint8 batches normalised equal the NCHW path bit for bit."""

import pytest
import torch

from loadopt.config import PipelineConfig
from loadopt.device import DeviceTransfer, finish_inputs


@pytest.mark.parametrize("size", [32, 30])  # 32 x 32 takes the channels-last path, 30 x 30 (900 % 16) does not
def test_nhwc_normalisation_equals_the_nchw_path(size):
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
