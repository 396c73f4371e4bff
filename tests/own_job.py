"""What the tests of a job's own pipeline share: the example job's modules (`examples/own_pipeline`), an epoch's
batches, and batches compared across paths, the Hugging Face form of its samples."""

import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_pipeline"
sys.path.insert(0, str(EXAMPLE))

import own_augment  # noqa: E402, F401 - the example job's modules, imported by the tests from here
import own_data  # noqa: E402, F401


def epoch_of(loader, batches=None):
    out = []
    for inputs, labels, *fields in loader:
        out.append((inputs.clone(), labels.clone(), *fields))
        if len(out) == batches:  # the state now says these were delivered, and no more
            break
    return out


def assert_same(reference, other, what):
    assert len(reference) == len(other), what
    for n, (mine, theirs) in enumerate(zip(reference, other, strict=True)):
        assert torch.equal(mine[1], theirs[1]), f"{what}: labels of batch {n}"
        assert torch.equal(mine[0], theirs[0]), f"{what}: pixels of batch {n}"
        assert len(mine) == len(theirs), f"{what}: fields of batch {n}"
        for name, value in (mine[2] if len(mine) > 2 else {}).items():
            other_value = theirs[2][name]
            same = torch.equal(value, other_value) if isinstance(value, torch.Tensor) else value == other_value
            assert same, f"{what}: field {name} of batch {n}"




def hugging_face_captioned(own):
    """The example job's samples as a Hugging Face dataset: its images by path (`Image()`), class names
    (`ClassLabel`) and captions."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=own.classes),
                                  "caption": datasets.Value("string")})
    return datasets.Dataset.from_dict({"image": [str(p) for p, _ in own.files], "label": own.targets,
                                       "caption": [own.caption(i) for i in range(len(own))]}, features=features)
