"""Crop boxes in source pixels: torchvision's RandomResizedCrop parameters and the eval centre crop."""

from __future__ import annotations

import math

import numpy as np

Box = tuple[float, float, float, float]  # left, top, right, bottom in source pixels
EVAL_CROP_FRACTION = 0.875  # resize to size/0.875, centre-crop size: the usual ImageNet eval recipe


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> Box:
    """torchvision's RandomResizedCrop parameters: ten tries at a random area and aspect ratio,
    then a centre crop clamped to the allowed ratios."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return (left, top, left + w, top + h)
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return (left, top, left + w, top + h)


def center_crop_box(width: int, height: int, fraction: float = EVAL_CROP_FRACTION) -> Box:
    """The centred square of `fraction` of the shorter side, in exact (fractional) source pixels:
    resampling it to the output size equals resizing the shorter side to size/fraction, then
    centre-cropping, as torchvision's Resize + CenterCrop do."""
    side = min(width, height) * fraction
    left, top = (width - side) / 2, (height - side) / 2
    return (left, top, left + side, top + side)


def whole_pixels(box: Box) -> tuple[int, int, int, int]:
    """A box rounded to whole pixels, as the torch kernel's crop takes it."""
    left, top, right, bottom = (int(round(v)) for v in box)
    return left, top, right, bottom
