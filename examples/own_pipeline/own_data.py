"""A job's own dataset, as training code writes it: a `torch.utils.data.Dataset` over a folder of JPEGs
(`<root>/<class>/<name>.jpg`, a caption beside each in `<name>.txt`), items `(PIL image, class index)`.

`CaptionedSamples` gives the same samples as dicts with their captions. `make(split)` is what a config names as
`dataset.factory: own_data:make`; `write_folder` makes a small folder of
this shape for the examples and tests to run on.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch.utils.data
from PIL import Image


class CaptionedJpegs(torch.utils.data.Dataset):
    """The JPEGs of `root`'s class folders, each opened with PIL, and its caption."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.files = [(path, label) for label, name in enumerate(self.classes)
                      for path in sorted((self.root / name).glob("*.jpg"))]
        self.targets = [label for _, label in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        path, label = self.files[index]
        return Image.open(path), label

    def caption(self, index: int) -> str:
        return self.files[index][0].with_suffix(".txt").read_text()


class CaptionedSamples(CaptionedJpegs):
    """The same samples as dicts, as a CLIP-style job reads them: its image, label and caption."""

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        image, label = super().__getitem__(index)
        return {"image": image, "label": label, "caption": self.caption(index)}


def make(split: str = "train") -> tuple[CaptionedJpegs, str]:
    """The dataset of `$OWN_DATA/<split>` and its version (the folder's names, sizes and times: it changes
    whenever a file does)."""
    root = Path(os.environ.get("OWN_DATA", "own-data")) / split
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder (set OWN_DATA, or run `python own_data.py {root.parent}`)")
    dataset = CaptionedJpegs(root)
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p, _ in dataset.files]
    return dataset, str(hash(tuple(stats)) & 0xFFFFFFFFFFFF)


def write_folder(root: str | os.PathLike[str], count: int = 48, classes: int = 4, seed: int = 0) -> Path:
    """`count` random JPEGs of 40-120 px a side in `classes` class folders of `<root>/train`, with captions."""
    rng = np.random.default_rng(seed)
    split = Path(root) / "train"
    for index in range(count):
        folder = split / f"class{index % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        height, width = (int(v) for v in rng.integers(40, 121, 2))
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index:04d}.jpg", quality=90)
        (folder / f"{index:04d}.txt").write_text(f"a picture of class {index % classes}, number {index}")
    return split


if __name__ == "__main__":
    import sys

    print(write_folder(sys.argv[1] if len(sys.argv) > 1 else "own-data"))
