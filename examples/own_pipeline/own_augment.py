"""A job's own per-sample transforms, as they are written for a DataLoader's workers: they draw from Python's
`random`, NumPy's global generator and torch's, which loadopt seeds per sample before each call.

- `train`: after loadopt's crop (`augment: train`), a random brightness and a random 90-degree turn;
- `crop_and_jitter`: the whole pipeline with `augment: none` (loadopt crops nothing): a random square crop of the
  decoded image, resized to 64 px, then the same jitter.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image

SIZE = 64


def train(image: Image.Image) -> np.ndarray:
    pixels = np.asarray(image, dtype=np.int16)
    pixels = pixels + random.randint(-20, 20) + int(np.random.randint(-10, 11))
    turns = int(torch.randint(0, 4, ()).item())
    return np.ascontiguousarray(np.rot90(np.clip(pixels, 0, 255).astype(np.uint8), turns))


def crop_and_jitter(image: Image.Image) -> np.ndarray:
    side = random.randint(min(image.size) // 2, min(image.size))
    left = random.randint(0, image.width - side)
    top = int(np.random.randint(0, image.height - side + 1))
    return train(image.crop((left, top, left + side, top + side)).resize((SIZE, SIZE), Image.BILINEAR))
