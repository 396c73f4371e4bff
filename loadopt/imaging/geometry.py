"""Crop boxes in source pixels: torchvision's RandomResizedCrop parameters and the eval centre crop."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

Box = tuple[float, float, float, float]  # left, top, right, bottom in source pixels
EVAL_CROP_FRACTION = 0.875  # resize to size/0.875, centre-crop size: the usual ImageNet eval recipe


TRIES = 10  # torchvision's RandomResizedCrop: ten tries at a random area and aspect ratio
UNIFORMS_PER_SAMPLE = 4 * TRIES  # area, aspect, top, left of each try


def random_resized_crop_boxes(widths: np.ndarray, heights: np.ndarray, uniforms: np.ndarray,
                              scale: tuple[float, float] = (0.08, 1.0),
                              ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
    """torchvision's RandomResizedCrop parameters for a batch, vectorised: ten tries at a random area
    and aspect ratio, the first that fits taken, else a centre crop clamped to the allowed ratios.
    `uniforms` (B, >= UNIFORMS_PER_SAMPLE) in [0, 1): try t draws columns 4t..4t+3 (area, log-aspect,
    top, left). Returns (B, 4) int64 boxes (left, top, right, bottom) in source pixels."""
    width, height = widths.astype(np.float64)[:, None], heights.astype(np.float64)[:, None]
    draws = uniforms[:, :UNIFORMS_PER_SAMPLE].reshape(len(widths), TRIES, 4)
    target_area = width * height * (scale[0] + (scale[1] - scale[0]) * draws[..., 0])
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    # math.exp, not np.exp: `random_resized_crop_box` (one sample, plain Python) must agree to the last bit,
    # and numpy's SIMD exp may round differently; every other operation here is exactly rounded in both.
    exponents = log_low + (log_high - log_low) * draws[..., 1]
    aspect = np.fromiter(map(math.exp, exponents.ravel().tolist()), np.float64, exponents.size).reshape(exponents.shape)
    w, h = np.rint(np.sqrt(target_area * aspect)), np.rint(np.sqrt(target_area / aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = np.argmax(fits, axis=1)  # the first try that fits (0 where none does: masked below)
    rows = np.arange(len(widths))
    w, h, draws = w[rows, first], h[rows, first], draws[rows, first]
    top = np.floor(draws[:, 2] * (heights - h + 1))
    left = np.floor(draws[:, 3] * (widths - w + 1))
    boxes = np.stack([left, top, left + w, top + h], axis=1).astype(np.int64)
    none_fit = ~fits.any(axis=1)
    if none_fit.any():
        boxes[none_fit] = [clamped_centre_box(int(a), int(b), ratio) for a, b in
                           zip(widths[none_fit], heights[none_fit], strict=True)]
    return boxes


def random_resized_crop_box(width: int, height: int, uniform: Callable[[int], float],
                            scale: tuple[float, float] = (0.08, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """`random_resized_crop_boxes` for one sample in plain Python (no numpy call per value: ~10x cheaper
    for a single sample), the same arithmetic: `uniform(k)` is column k of its uniforms."""
    area = width * height
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for attempt in range(TRIES):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * uniform(4 * attempt))
        aspect = math.exp(log_low + (log_high - log_low) * uniform(4 * attempt + 1))
        w, h = round(math.sqrt(target_area * aspect)), round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = math.floor(uniform(4 * attempt + 2) * (height - h + 1))
            left = math.floor(uniform(4 * attempt + 3) * (width - w + 1))
            return (left, top, left + w, top + h)
    return clamped_centre_box(width, height, ratio)


def clamped_centre_box(width: int, height: int,
                       ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """RandomResizedCrop's fallback: the whole image, centre-cropped to the allowed aspect ratios."""
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
