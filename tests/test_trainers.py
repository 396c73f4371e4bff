"""The trainers' own loops over a loadopt loader: Lightning's DataModule and Accelerate's `prepare` (the examples,
run as users run them), and the device `auto` takes under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loadopt.device import resolve_device

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--backend", "torch", "--set", "dataset.synthetic.num_samples=200", "--set",
         "dataset.synthetic.num_classes=10", "--set", "pipeline.batch_size=16", "--set", "pipeline.image_size=64",
         "--set", "loaders.torch.num_workers=1"]


def first_labels(output: str) -> dict[str, str]:
    return dict(line.split(": first labels ", 1) for line in output.splitlines() if ": first labels " in line)


@pytest.mark.parametrize("example, package", [("lightning_datamodule.py", "lightning"),
                                              ("accelerate_loop.py", "accelerate")])
def test_the_trainer_example_runs_and_its_epochs_differ(example, package, tmp_path):
    pytest.importorskip(package)
    extra = ["--cpu", "--steps", "2"] if package == "accelerate" else ["--batches", "2"]
    done = subprocess.run([sys.executable, str(REPO / "examples" / example), str(REPO / "configs" / "imagenet.yaml"),
                           *SMALL, *extra], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LOADOPT_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    epochs = first_labels(done.stdout)
    assert set(epochs) == {"epoch 0", "epoch 1"}, done.stdout
    assert epochs["epoch 0"] != epochs["epoch 1"]


def test_auto_takes_the_local_rank_device_under_torchrun(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("auto") == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device(None) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("auto") == torch.device("cpu")
