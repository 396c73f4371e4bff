"""Recycled host memory for the batches handed to a training loop on the CPU: reused only once nothing refers to it."""

import pytest
import torch

from loadopt import make_loader
from loadopt.loaders.recycled_memory import RecycledBuffers

from .conftest import tiny_config_dict


def test_a_buffer_returns_only_when_the_tensor_and_every_view_are_gone():
    memory = RecycledBuffers()
    batch = memory.empty((4, 3, 8, 8), torch.float32)
    address = batch.data_ptr()
    view = batch[1:]
    del batch
    assert memory.free_buffers() == 0  # the view still reads it
    del view
    assert memory.free_buffers() == 1
    again = memory.empty((4, 3, 8, 8), torch.float32)
    assert again.data_ptr() == address and again.is_contiguous() and again.dtype == torch.float32


def test_a_tensor_saved_for_backward_keeps_its_buffer():
    memory = RecycledBuffers()
    batch = memory.empty((2, 4), torch.float32).fill_(2.0)
    weight = torch.ones(2, 4, requires_grad=True)
    loss = (batch * weight).sum()  # autograd keeps `batch` to compute weight's gradient
    del batch
    assert memory.free_buffers() == 0
    overwrite = memory.empty((2, 4), torch.float32).fill_(-1.0)  # must be other memory
    loss.backward()
    assert torch.equal(weight.grad, torch.full((2, 4), 2.0)) and overwrite.sum() == -8
    del loss
    assert memory.free_buffers() == 1


def test_other_dtypes_and_empty_shapes():
    memory = RecycledBuffers()
    assert memory.empty((3, 5), torch.bfloat16).shape == (3, 5)
    assert memory.empty((0, 3), torch.float32).numel() == 0


@pytest.mark.parametrize("backend,settings", [("arrow", {"form": "decoded", "threads": 1}),
                                              ("torch", {"variant": "tuned", "num_workers": 1})])
def test_batches_a_loop_keeps_are_never_written_over(tmp_path, backend, settings):
    config = tiny_config_dict(tmp_path / "r", dataset={"synthetic": {"num_samples": 40, "num_classes": 4,
                                                                        "mean_width": 64, "mean_height": 56,
                                                                        "seed": 3}})
    loader = make_loader(config, backend=backend, device="cpu", batch_size=8, **settings)
    kept, copies = [], []
    for epoch in range(2):  # dropped batches of the first epoch give their memory to the second's
        loader.set_epoch(epoch)
        for n, (images, _) in enumerate(loader):
            if epoch == 1 or n % 2 == 0:
                kept.append(images)
                copies.append(images.clone())
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(kept, copies, strict=True))
    assert len({t.data_ptr() for t in kept}) == len(kept)
