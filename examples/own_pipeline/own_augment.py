"""A job's own per-sample transforms, as they are written for a DataLoader's workers: they draw from Python's
`random`, NumPy's global generator and torch's, which loadopt seeds per sample before each call.

- `train`: after loadopt's crop (`augment: train`), a random brightness and a random 90-degree turn;
- `crop_and_jitter`: the whole pipeline with `augment: none` (loadopt crops nothing): a random square crop of the
  decoded image, resized to 64 px, then the same jitter;
- `resize_and_flip_boxes`: a detection job's, of (image, target) with `transform_target: true` and `augment: none`:
  the image resized to 64 px and flipped at random, its `boxes` moved with it.
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


def resize_and_flip_boxes(image: Image.Image, target: dict) -> tuple[Image.Image, dict]:
    """Resize to SIZE square and flip left-right half the time; `target["boxes"]` ([x0, y0, x1, y1] in pixels)
    scaled and flipped with the image."""
    sx, sy = SIZE / image.width, SIZE / image.height
    boxes = [[x0 * sx, y0 * sy, x1 * sx, y1 * sy] for x0, y0, x1, y1 in target["boxes"]]
    image = image.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
    if random.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        boxes = [[SIZE - x1, y0, SIZE - x0, y1] for x0, y0, x1, y1 in boxes]
    return image, {**target, "boxes": boxes}
