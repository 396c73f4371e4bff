"""`loadopt measure` ends with the loop's own pipeline on loadopt's paths: taken apart from a torchvision-style
DataLoader (its dataset's files, its transform before ToTensor/Normalize), or one line saying why not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from torchvision_style import Compose, ImageFolder, Normalize, RandomResizedCrop, ToTensor  # noqa: E402

from loadopt.measure.paths import job_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    sys.path.insert(0, str(REPO / "examples" / "own_pipeline"))
    import own_data

    return own_data.write_folder(tmp_path_factory.mktemp("measure") / "data", count=16)


def test_the_pipeline_is_taken_apart_from_a_torchvision_style_dataloader(folder):
    dataset = ImageFolder(folder, transform=Compose([RandomResizedCrop(48), ToTensor(), Normalize((0.5,) * 3,
                                                                                                    (0.25,) * 3)]))
    job = job_pipeline(torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1))
    assert not isinstance(job, str)
    assert (job.image_size, job.mean, job.std, job.batch_size, job.workers) == (48, (0.5,) * 3, (0.25,) * 3, 4, 1)
    assert job.described == "RandomResizedCrop + ToTensor/Normalize on the device"
    assert job.dataset[0] == dataset.samples[0]  # the file, not the decoded image
    assert dataset.transform is not None  # the script's own dataset is left as it was


class RandomErasing:
    def __call__(self, tensor):
        return tensor


@pytest.mark.parametrize("transform, why", [
    (None, "its dataset has no `.transform`"),
    (Compose([RandomResizedCrop(48), ToTensor(), RandomErasing(), Normalize((0.5,) * 3, (0.25,) * 3)]),
     "its transform works on tensors after ToTensor"),
])
def test_what_cannot_be_taken_apart_says_why(folder, transform, why):
    found = job_pipeline(torch.utils.data.DataLoader(ImageFolder(folder, transform=transform), batch_size=4))
    assert isinstance(found, str) and found.startswith(why)


def test_loadopt_measure_ends_with_the_loops_pipeline_on_loadopts_paths(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "loadopt", "measure", "--out", str(tmp_path / "out"),
         str(REPO / "examples" / "train_classifier.py"), str(REPO / "configs" / "imagenet.yaml"), "--backend",
         "dataloader", "--epochs", "1", "--max-steps", "6", "--set", "dataset.synthetic.num_samples=200", "--set",
         "pipeline.batch_size=16", "--set", "pipeline.image_size=64"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "LOADOPT_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("this loop's pipeline on loadopt's paths"))
    assert "ImageFolder, first 200 samples; RandomResizedCrop, RandomHorizontalFlip + ToTensor/Normalize on the " \
           "device; 64 px, batch 16" in lines[head]
    rows = lines[head + 1 : head + 6]
    assert rows[0].split()[:3] == ["your", "DataLoader", "(workers=2)"] and "samples/s" in rows[0]
    assert [row.split()[0] for row in rows[1:]] == ["torch", "arrow", "posix", "dali"]
    assert all("samples/s" in row and row.rstrip().endswith("x") for row in rows[1:]), rows
    assert lines[head + 6].startswith("fastest for this pipeline: ")
    assert lines[head + 7].startswith("the loop waited for data ")


# A Hugging Face image-classification tutorial's transform: one composition, applied to each image of the batch.
TUTORIAL = Compose([RandomResizedCrop(48), ToTensor(), Normalize((0.5,) * 3, (0.25,) * 3)])


def tutorial_transforms(examples):
    examples["pixel_values"] = [TUTORIAL(image.convert("RGB")) for image in examples["image"]]
    del examples["image"]
    return examples


def test_a_hugging_face_dataset_with_set_transform_is_taken_apart_and_run_on_loadopts_paths(folder, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from loadopt.measure import paths

    files = sorted(folder.glob("*/*.jpg"))
    classes = sorted({path.parent.name for path in files})
    dataset = datasets.Dataset.from_dict(
        {"image": [str(path) for path in files], "label": [classes.index(path.parent.name) for path in files]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)}))
    dataset.set_transform(tutorial_transforms)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    job = job_pipeline(loader)
    assert not isinstance(job, str), job
    assert (job.image_size, job.mean, job.std, job.batch_size) == (48, (0.5,) * 3, (0.25,) * 3, 4)
    assert job.described == "RandomResizedCrop + ToTensor/Normalize on the device"
    assert job.dataset_name == "Hugging Face Dataset" and len(job.dataset) == len(files)
    assert dataset.format["type"] == "custom"  # the script's own dataset is left as it was
    monkeypatch.setattr(paths, "BATCHES", 2)
    rates = dict(paths.path_rates(job, lambda: loader))
    assert all(isinstance(rate, float) and rate > 0 for rate in rates.values()), rates


def test_a_hugging_face_transform_without_one_composition_says_why(folder):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"image": [str(p) for p in sorted(folder.glob("*/*.jpg"))]},
                                         features=datasets.Features({"image": datasets.Image()}))
    dataset.set_transform(lambda examples: examples)
    found = job_pipeline(torch.utils.data.DataLoader(dataset, batch_size=4))
    assert isinstance(found, str) and "uses no torchvision-style compositions (Compose) by name" in found, found
