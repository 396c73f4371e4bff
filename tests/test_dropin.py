"""`make_loader` as a drop-in for DataLoader: torchvision's reference classification loop
(references/classification/train.py: `train_one_epoch`, then `evaluate` reading `len(loader.dataset)`)
with only its two loader lines swapped, on every backend available here."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from loadopt import make_loader
from loadopt.errors import ConfigError, DatasetError
from loadopt.loaders.registry import backend_class

from .conftest import make_image_folder

NUM_CLASSES = 4
BACKENDS = ["torch", "arrow", "posix", "dali", "kvikio"]


def tiny(seed: int = 11, **pipeline) -> dict:
    """48 train and 12 val images (a dataset of its own: other test files record decisions for theirs)."""
    return {"dataset": {"synthetic": {"num_samples": 48, "num_classes": NUM_CLASSES, "mean_width": 96,
                                      "mean_height": 80, "seed": seed, "val_fraction": 0.25}},
            "pipeline": {"batch_size": 8, "image_size": 48, **pipeline}, "workload": {"device": "cpu"}}


def available(name: str) -> str:
    ok, reason = backend_class(name).available()
    if not ok:
        pytest.skip(f"backend {name} is not available here: {reason}")
    return name


# -- the reference script's shape (torchvision references/classification/train.py, utils.py) --------------------

class MixUp:
    """torchvision.transforms.v2.MixUp's arithmetic (torchvision is optional here): the batch rolled by one
    and blended with it, labels one-hot and blended the same way."""

    def __init__(self, num_classes: int, alpha: float = 0.2) -> None:
        self.num_classes, self.beta = num_classes, torch.distributions.Beta(alpha, alpha)
        self.calls = 0

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        lam = float(self.beta.sample())
        onehot = nn.functional.one_hot(labels, self.num_classes).float()
        return images.roll(1, 0) * (1 - lam) + images * lam, onehot.roll(1, 0) * (1 - lam) + onehot * lam


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    if target.ndim == 2:  # mixup/cutmix targets, as the reference's utils.accuracy does
        target = target.max(dim=1)[1]
    return float((output.argmax(1) == target).float().mean())


def train_one_epoch(model, criterion, optimizer, data_loader, device) -> int:
    model.train()
    steps = 0
    for image, target in data_loader:
        image, target = image.to(device), target.to(device)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        accuracy(output, target)
        assert target.shape == (image.shape[0], NUM_CLASSES)  # the batch went through the mixup
        steps += 1
    return steps


def evaluate(model, criterion, data_loader, device) -> tuple[int, list[int], list[torch.Tensor]]:
    model.eval()
    num_processed_samples, labels, images = 0, [], []
    with torch.inference_mode():
        for image, target in data_loader:
            image = image.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            criterion(model(image), target)
            num_processed_samples += image.shape[0]
            labels += target.tolist()
            images.append(image.clone())
    # The reference warns when this differs: some samples were dropped or repeated.
    assert len(data_loader.dataset) == num_processed_samples
    return num_processed_samples, labels, images


def small_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, NUM_CLASSES))


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchvision_reference_loop(backend):
    available(backend)
    torch.manual_seed(0)
    mixup_cutmix = MixUp(NUM_CLASSES)
    workers, data_path = 1, tiny()
    # The two lines that replace the reference's two DataLoader(...) calls:
    data_loader = make_loader(data_path, "train", backend, batch_size=8, num_workers=workers, pin_memory=True,
                              batch_transform=mixup_cutmix)
    data_loader_test = make_loader(data_path, "val", backend, batch_size=8, num_workers=workers, pin_memory=True)

    assert data_loader.batch_size == 8 and data_loader.drop_last is False and len(data_loader) == 6
    dataset = data_loader.dataset
    assert len(dataset) == 48 and len(dataset.classes) == NUM_CLASSES
    assert dataset.class_to_idx == {name: i for i, name in enumerate(dataset.classes)}
    assert dataset.targets == [i % NUM_CLASSES for i in range(48)] and len(dataset.samples) == 48
    path, label = dataset.samples[5]
    assert path.endswith(".JPEG") and label == dataset.targets[5] == 1
    model = small_model()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(2):
        assert train_one_epoch(model, criterion, optimizer, data_loader, "cpu") == len(data_loader)
        seen.append(evaluate(model, criterion, data_loader_test, "cpu"))
    assert mixup_cutmix.calls == 2 * len(data_loader)
    # val: every sample once, in the dataset's order, with the eval crop (the same pixels every epoch)
    count, labels, images = seen[0]
    assert count == len(data_loader_test.dataset) == 12 and labels == data_loader_test.dataset.targets
    assert all(torch.equal(a, b) for a, b in zip(images, seen[1][2], strict=True))
    assert images[0].shape == (8, 3, 48, 48) and images[0].dtype == torch.float32
    data_loader.close()
    data_loader_test.close()


@pytest.mark.parametrize("backend", ["torch", "arrow", "posix", "dali"])
def test_val_split_is_every_sample_once_in_order_with_eval_crops(backend, caplog):
    available(backend)
    with caplog.at_level(logging.INFO, logger="loadopt"):
        val = make_loader(tiny(), "val", backend, num_workers=1)
    assert (val.pipeline.augment, val.pipeline.shuffle, val.pipeline.drop_last) == ("eval", "none", False)
    assert "split 'val': augment=eval, shuffle=False, drop_last=False" in caplog.text
    indices = np.concatenate([b.indices for b in val.host_batches()])
    assert indices.tolist() == list(range(12))  # every sample once, unshuffled
    first, second = [[images for images, _ in val] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # the eval crop: no randomness
    # The same split with train augmentation (asked for explicitly) crops at random: the check above can fail.
    train_aug = make_loader(tiny(), "val", backend, num_workers=1, augment="train", shuffle=False)
    assert train_aug.pipeline.augment == "train"
    assert not all(torch.equal(a, b) for a, b in zip(first, [images for images, _ in train_aug], strict=True))
    val.close()
    train_aug.close()


@pytest.mark.parametrize("backend", ["torch", "arrow", "dali"])
def test_break_then_for_is_a_full_pass_and_load_state_dict_resumes(backend):
    available(backend)
    loader = make_loader(tiny(), "train", backend, num_workers=1)
    full = [labels.tolist() for _, labels in loader]  # epoch 0, a whole pass: the loader moves to epoch 1
    loader.set_epoch(0)
    for step, _ in enumerate(loader):
        if step == 2:
            state = loader.state_dict()
        if step == 3:
            break
    again = [labels.tolist() for _, labels in loader]  # a new `for` after the break: all of epoch 0 again
    assert len(again) == len(loader) == 6 and again == full
    resumed = make_loader(tiny(), "train", backend, num_workers=1)
    resumed.load_state_dict(state)
    rest = [labels.tolist() for _, labels in resumed]  # right after load_state_dict: the remainder
    assert rest == full[3:]
    assert len([labels for _, labels in resumed]) == 6  # and the next `for` is a whole pass (epoch 1)
    assert resumed.epoch == 2
    loader.close()
    resumed.close()


@pytest.mark.parametrize("backend", ["torch", "arrow", "posix", "dali"])
def test_memory_format_is_honoured_by_every_backend(backend):
    available(backend)
    out = {}
    for fmt in ("channels_last", "contiguous"):
        loader = make_loader(tiny(), "val", backend, num_workers=1, memory_format=fmt)
        out[fmt] = [images for images, _ in loader]
        loader.close()
    assert all(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
               for x in out["channels_last"])
    assert all(x.is_contiguous() for x in out["contiguous"])
    assert all(torch.equal(a, b) for a, b in zip(out["channels_last"], out["contiguous"], strict=True))


def test_dataloader_keywords_accepted_mapped_or_refused(caplog):
    with caplog.at_level(logging.INFO, logger="loadopt"):
        arrow = make_loader(tiny(), "val", "arrow", num_workers=3, pin_memory=True)
    assert arrow.settings.threads == 3
    assert "threads=3 (num_workers=3 passed to make_loader: arrow's threads in this process" in caplog.text
    assert "pin_memory=True: arrow has no such knob (its batch ring is pinned whenever the device is CUDA)" \
        in caplog.text
    assert make_loader(tiny(), "val", "posix", num_workers=0).settings.threads == 1
    torch_loader = make_loader(tiny(), "val", "torch", num_workers=0, pin_memory=False)
    assert (torch_loader.settings.num_workers, torch_loader.settings.pin_memory) == (0, False)
    with pytest.raises(ConfigError, match=r"collate_fn= is not supported: .*pass batch_transform=fn instead"):
        make_loader(tiny(), collate_fn=lambda batch: batch)
    with pytest.raises(ConfigError, match=r"sampler= is not supported: .*loader.set_epoch\(epoch\)"):
        make_loader(tiny(), sampler=object())
    with pytest.raises(ConfigError, match="batch_transform= must be a function"):
        make_loader(tiny(), batch_transform=3)
    with pytest.raises(ConfigError, match="num_workers must be a whole number"):
        make_loader(tiny(), "val", "arrow", num_workers=-1)


def test_a_missing_split_folder_is_named(tmp_path):
    make_image_folder(tmp_path / "data")
    with pytest.raises(DatasetError, match=r"no split folder 'test' \(expected <root>/test/<class>/; folders "
                                           r"there: train\)"):
        make_loader({"dataset": {"path": str(tmp_path / "data")}}, "test", "torch")
    # A bare class tree is still a train split of its own.
    assert len(make_loader({"dataset": {"path": str(tmp_path / "data" / "train")}}, "train", "torch").dataset) == 12


def test_a_symlinked_tree_reuses_the_conversion(tmp_path, monkeypatch):
    make_image_folder(tmp_path / "data")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    first = make_loader({"dataset": {"path": str(tmp_path / "data")}}, backend="arrow")  # converts
    monkeypatch.setattr("loadopt.api.FALLBACK_ORDER", ("arrow",))  # auto converts nothing: it must find it
    again = make_loader({"dataset": {"path": str(tmp_path / "link")}})
    assert again.name == "arrow" and again.dataset.fingerprint == first.dataset.fingerprint
    assert again.dataset.root.startswith(str(tmp_path / "link"))
    assert [labels.tolist() for _, labels in again] == [labels.tolist() for _, labels in first]
