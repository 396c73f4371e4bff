"""examples/train_classifier.py: the same label sequence with every available backend, and across a resume."""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from loadopt.errors import DatasetError
from loadopt.loaders.registry import backend_class, backend_names

from .conftest import REPO, tiny_config_dict

STEPS = 9  # one epoch of 6 batches and 3 of the next
STOP = 4  # the preemption, mid-epoch


def _example():
    spec = importlib.util.spec_from_file_location("train_classifier", REPO / "examples" / "train_classifier.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("train")
    path = folder / "train.yaml"
    # 48 samples, batches of 8: 6 per epoch. Workers off, so the test stays quick.
    path.write_text(yaml.safe_dump(tiny_config_dict(folder / "out", loaders={"torch": {"num_workers": 0}})))
    return path


@pytest.fixture(scope="module")
def reference(example, config_path, cache_dir):
    import os

    os.environ["LOADOPT_CACHE"] = str(cache_dir)  # module fixture: the autouse per-test cache is not set yet
    return example.train(str(config_path), "torch", epochs=2, max_steps=STEPS)


@pytest.mark.parametrize("backend", backend_names())
def test_same_labels_with_every_backend_and_across_a_resume(example, config_path, reference, backend, tmp_path):
    available, reason = backend_class(backend).available()
    if not available:
        pytest.skip(f"backend {backend} is not available here: {reason}")
    try:
        full = example.train(str(config_path), backend, epochs=2, max_steps=STEPS)
    except DatasetError as exc:
        pytest.skip(f"backend {backend} cannot read the tiny dataset: {exc}")
    assert len(full) == STEPS and all(len(labels) == 8 for labels in full)
    # the shared sample order: a switch of backend changes nothing but speed (a peer keeps its library's)
    expected = reference if backend_class(backend).shared_order else full
    assert full == expected
    checkpoint = tmp_path / "ckpt.pt"
    first = example.train(str(config_path), backend, epochs=2, max_steps=STOP, checkpoint=str(checkpoint))
    rest = example.train(str(config_path), backend, epochs=2, max_steps=STEPS, resume=str(checkpoint))
    assert first + rest == expected and len(first) == STOP


def test_the_script_runs_from_the_command_line(example, config_path, tmp_path):
    import json

    from loadopt.config import load_config
    from loadopt.storage.open import open_dataset

    out = tmp_path / "labels.json"
    assert example.main([str(config_path), "--backend", "torch", "--epochs", "1", "--labels-out", str(out)]) == 0
    labels = json.loads(out.read_text())
    dataset = open_dataset(load_config(config_path))
    assert len(labels) == 6  # one epoch: every sample once
    assert sorted(x for batch in labels for x in batch) == sorted(dataset.labels.tolist())
