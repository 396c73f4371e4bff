"""torchvision's `ImageFolder` and the transforms of its classification reference, or, where torchvision does not
import beside the installed torch, stand-ins of the same names and behaviour (for the examples and tests only)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

try:  # the real ones, where they import
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop, ToTensor
except Exception:  # noqa: BLE001 - any import failure: the stand-ins below

    class ImageFolder(torch.utils.data.Dataset):  # type: ignore[no-redef]
        """`<root>/<class>/<image>`: items (the transformed RGB image, its class index), as torchvision's."""

        def __init__(self, root, transform=None, target_transform=None):
            self.root = str(root)
            self.classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
            self.samples = [(str(path), self.class_to_idx[name]) for name in self.classes
                            for path in sorted((Path(root) / name).iterdir())
                            if path.suffix.lower() in (".jpg", ".jpeg", ".png")]
            self.targets = [target for _, target in self.samples]
            self.transform, self.target_transform = transform, target_transform

        def __len__(self):
            return len(self.samples)

        def __getitem__(self, index):
            path, target = self.samples[index]
            with open(path, "rb") as handle:
                image = Image.open(handle).convert("RGB")
            return (self.transform(image) if self.transform else image), target

    class Compose:  # type: ignore[no-redef]
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, image):
            for transform in self.transforms:
                image = transform(image)
            return image

    class RandomResizedCrop:  # type: ignore[no-redef]
        """torchvision's: a random area (8-100%) and aspect ratio (3/4-4/3), up to 10 tries, else the centre."""

        def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
            self.size, self.scale, self.ratio = size, scale, ratio

        def __call__(self, image):
            width, height = image.size
            area = width * height
            for _ in range(10):
                target = area * random.uniform(*self.scale)
                aspect = math.exp(random.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
                w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
                if 0 < w <= width and 0 < h <= height:
                    left, top = random.randint(0, width - w), random.randint(0, height - h)
                    break
            else:
                w = h = min(width, height)
                left, top = (width - w) // 2, (height - h) // 2
            return image.resize((self.size, self.size), Image.BILINEAR, box=(left, top, left + w, top + h))

    class RandomHorizontalFlip:  # type: ignore[no-redef]
        def __init__(self, p=0.5):
            self.p = p

        def __call__(self, image):
            return image.transpose(Image.FLIP_LEFT_RIGHT) if random.random() < self.p else image

    class ToTensor:  # type: ignore[no-redef]
        def __call__(self, image):
            return torch.from_numpy(np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0)

    class Normalize:  # type: ignore[no-redef]
        def __init__(self, mean, std):
            self.mean, self.std = list(mean), list(std)

        def __call__(self, tensor):
            return (tensor - torch.tensor(self.mean).view(3, 1, 1)) / torch.tensor(self.std).view(3, 1, 1)


def classification_train(size: int = 224):
    """The reference script's training transform: RandomResizedCrop, flip, to a tensor, ImageNet's normalisation."""
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(),
                    Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
