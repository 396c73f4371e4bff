"""The image pipeline every CPU backend shares: decode, crop box, resize, flip, normalise.

loadopt's own equivalents of torchvision's RandomResizedCrop / Resize+CenterCrop / flip /
ToTensor+Normalize (torchvision is optional). Random choices come from a generator seeded by
(seed, epoch, sample index), so a sample gets the same crop whichever worker or backend decodes it.
Two resize kernels, both bilinear with antialiasing: PIL's
(`resize(box=...)`, what torchvision does on PIL images) and torch's uint8 kernel on a view of the
decoded array (what torchvision v2 does on tensors: about 3x cheaper here, no PIL<->numpy copies;
pixels differ from PIL's by rounding, mean |diff| < 0.1 of a level).
"""

from __future__ import annotations

import io
import math
from typing import Literal

import numpy as np
import torch
from PIL import Image

try:  # the faster libjpeg-turbo binding, GIL released while decoding
    import simplejpeg
except ImportError:  # pragma: no cover - simplejpeg is a dependency, but stay usable without it
    simplejpeg = None

try:  # OpenCV's SIMD mirror of a resized crop into its slot
    import cv2
except ImportError:  # pragma: no cover - a dependency; torch's flip (a copy) stays for installs without it
    cv2 = None  # type: ignore[assignment]  # None where the optional module is absent

try:  # libjpeg-turbo's region decoding (loadopt/_jpeg.c), built at install where libjpeg-turbo's headers are
    from loadopt import _jpeg as jpeg_region
except ImportError:  # pragma: no cover - optional; JPEGs are then decoded whole
    jpeg_region = None  # type: ignore[assignment]  # None where the optional module is absent

Box = tuple[float, float, float, float]  # left, top, right, bottom in source pixels
EVAL_CROP_FRACTION = 0.875  # resize to size/0.875, centre-crop size: the usual ImageNet eval recipe


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, epoch, int(index)]))


def sample_hash(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """64 random bits per sample from (seed, epoch, index), for a whole batch at once (splitmix64):
    per-sample randomness that does not depend on which batch or thread handles the sample."""
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)) ^ (np.uint64(epoch) * np.uint64(0xD1B54A32D192ED03))
        x = x ^ indices.astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


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


def plan(width: int, height: int, augment: Literal["train", "eval"], seed: int, epoch: int,
         index: int) -> tuple[Box, bool]:
    """The crop box (in source pixels) and whether to flip, for one sample."""
    if augment == "eval":
        return center_crop_box(width, height), False
    rng = sample_rng(seed, epoch, index)
    box = random_resized_crop_box(width, height, rng)
    return box, bool(rng.random() < 0.5)


def decode_pil(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()  # decode errors surface here, not later
    return image.convert("RGB") if image.mode != "RGB" else image


def decode_array(data: bytes, decoder: Literal["pil", "simplejpeg"]) -> np.ndarray:
    """Decode to a writable HWC uint8 array: simplejpeg for JPEGs when asked, PIL otherwise."""
    if decoder == "simplejpeg" and simplejpeg is not None and data[:2] == b"\xff\xd8":
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    return np.array(decode_pil(data))


def whole_pixels(box: Box) -> tuple[int, int, int, int]:
    """A box rounded to whole pixels, as the torch kernel's crop takes it."""
    left, top, right, bottom = (int(round(v)) for v in box)
    return left, top, right, bottom


def dct_denominator(box: tuple[int, int, int, int], size: int) -> int:
    """The largest JPEG DCT scale 1/d (d in 1, 2, 4, 8) at which the crop `box` still has at least
    `size` pixels each way: a crop at least twice the output is decoded at half scale or smaller."""
    width, height = box[2] - box[0], box[3] - box[1]
    return next(d for d in (8, 4, 2, 1) if d == 1 or (width >= d * size and height >= d * size))


def decode_planned(data: bytes, decoder: Literal["pil", "simplejpeg"], augment: Literal["train", "eval"],
                   seed: int, epoch: int, index: int, region: bool = True,
                   reduced_for: int | None = None) -> tuple[np.ndarray, Box, bool]:
    """Decode what one sample's crop needs: (HWC uint8 pixels, the crop box in their coordinates, flip).

    With `region` (the default) and libjpeg-turbo's region decoding built (`loadopt/_jpeg.c`), a JPEG
    for simplejpeg is decoded only over the crop's whole-pixel box: rows above it skipped, columns
    outside it never inverse-transformed, nothing below it read; the pixels equal the full decode's
    crop (tests/test_transforms.py), at 0.6-0.7x the time here. Otherwise the whole image is decoded.
    A JPEG the region decoder refuses (CMYK, corrupt) goes to the whole-image decoder, which reports it;
    damage below the crop goes unnoticed by the region decoder (it never reads there).

    `reduced_for` = the output size: a crop at least twice that is decoded at a reduced DCT scale
    (`dct_denominator`), the box in the scaled image's whole pixels. Other pixels than the full
    decode's (the DCT's downscale, then the resize), far less work on large photos; off by default."""
    if region and decoder == "simplejpeg" and jpeg_region is not None and bytes(data[:2]) == b"\xff\xd8":
        try:
            width, height = jpeg_region.header(data)
            box, flip = plan(width, height, augment, seed, epoch, index)
            left, top, right, bottom = whole_pixels(box)
            denom = dct_denominator((left, top, right, bottom), reduced_for) if reduced_for else 1
            if denom > 1:  # the scaled image is ceil(width / denom) wide; the box in its whole pixels
                scaled_width, scaled_height = -(-width // denom), -(-height // denom)
                left, top = min(round(left / denom), scaled_width - 1), min(round(top / denom), scaled_height - 1)
                right = max(min(round(right / denom), scaled_width), left + 1)
                bottom = max(min(round(bottom / denom), scaled_height), top + 1)
            region_pixels = jpeg_region.decode_region(data, denom, left, top, right, bottom)
        except ValueError:
            pass
        else:
            return (np.frombuffer(region_pixels, np.uint8).reshape(bottom - top, right - left, 3),
                    (0, 0, right - left, bottom - top), flip)
    pixels = decode_array(data, decoder)
    box, flip = plan(pixels.shape[1], pixels.shape[0], augment, seed, epoch, index)
    return pixels, box, flip


def decode_fast(data: bytes) -> Image.Image:
    """simplejpeg for JPEGs when installed, PIL for anything else; as a PIL image."""
    return Image.fromarray(decode_array(data, "simplejpeg"))


def crop_resize_flip(image: Image.Image, box: Box, flip: bool, size: int) -> np.ndarray:
    """The crop, resized to size x size (bilinear, antialiased) and flipped: HWC uint8."""
    out = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def resize_aa(crop: torch.Tensor, size: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """torch's antialiased bilinear resize of an NCHW batch (uint8 on the CPU: its integer kernel), as
    `F.interpolate(..., mode="bilinear", antialias=True)` computes it (the binding it calls: `torch.ops`'
    dispatch costs ~3x its Python overhead here), optionally written into `out`."""
    if out is None:
        # torch's stub lists only the (input, output_size, align_corners, scale_factors) overload of this binding
        return torch._C._nn._upsample_bilinear2d_aa(crop, size, False, None, None)  # type: ignore[call-arg]
    return torch._C._nn._upsample_bilinear2d_aa(crop, size, False, None, None, out=out)  # type: ignore[call-arg]


def crop_resize_flip_into(pixels: np.ndarray, box: Box, flip: bool, out: torch.Tensor,
                          fused: bool = True) -> None:
    """The crop of an HWC uint8 array, resized with torch's uint8 antialiased bilinear kernel and
    flipped, written into `out` (CHW uint8, e.g. one slot of a batch).

    `fused` (the default): an unflipped crop is resized straight into `out`, a flipped one mirrored
    into it by OpenCV where `out` is a view of HWC pixels, else by one reversed strided copy; the same
    pixels as resizing into a new tensor, flipping that (a copy) and copying it into `out`, which
    `fused` False does (bench/levers.py)."""
    left, top, right, bottom = whole_pixels(box)  # torch's kernel takes whole-pixel crops
    crop = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)[:, :, top:bottom, left:right]
    size = list(out.shape[-2:])
    if fused and not flip:
        resize_aa(crop, size, out.unsqueeze(0))
        return
    resized = resize_aa(crop, size)[0]
    hwc_in, hwc_out = resized.permute(1, 2, 0), out.permute(1, 2, 0)
    if fused and cv2 is not None and hwc_in.is_contiguous() and hwc_out.is_contiguous():  # both HWC in memory
        cv2.flip(hwc_in.numpy(), 1, dst=hwc_out.numpy())
    elif fused and out.device.type == "cpu":  # one strided copy, no flipped temporary
        np.copyto(out.numpy(), resized.numpy()[:, :, ::-1])
    else:
        out.copy_(resized.flip(-1) if flip else resized)


def crop_resize_flip_chw(chw: torch.Tensor, box: Box, flip: bool, out: torch.Tensor) -> None:
    """`crop_resize_flip_into` for a decoded CHW uint8 tensor on any device (e.g. a GPU decoder's
    output): torch's uint8 kernel on the CPU (so equal to `crop_resize_flip_into`), its float
    kernel rounded back to uint8 elsewhere (CUDA has no uint8 antialiased kernel: within a level)."""
    left, top, right, bottom = whole_pixels(box)
    crop = chw.unsqueeze(0)[:, :, top:bottom, left:right]
    if crop.device.type != "cpu":
        crop = crop.float()
    resized = resize_aa(crop, list(out.shape[-2:]))[0]
    if resized.dtype != torch.uint8:
        resized = resized.round_().clamp_(0, 255)
    out.copy_(resized.flip(-1) if flip else resized)


def pil_pixels(data: bytes, decoder: str, augment: Literal["train", "eval"], seed: int, epoch: int, index: int,
               size: int, reduced_scale: bool = False) -> np.ndarray:
    """Decode one sample and crop/resize/flip it with PIL's kernel: HWC uint8. `reduced_scale`: a crop
    at least twice `size` decoded at a reduced DCT scale (`decode_planned`; PIL's `draft` for `pil`)."""
    if reduced_scale and decoder != "pil":
        pixels, box, flip = decode_planned(data, decoder, augment, seed, epoch, index, True, size)
        return crop_resize_flip(Image.fromarray(pixels), box, flip, size)
    if not reduced_scale:
        image = decode_pil(data) if decoder == "pil" else decode_fast(data)
        box, flip = plan(image.width, image.height, augment, seed, epoch, index)
        return crop_resize_flip(image, box, flip, size)
    image = Image.open(io.BytesIO(data))
    width, height = image.size
    box, flip = plan(width, height, augment, seed, epoch, index)
    denom = dct_denominator(whole_pixels(box), size)
    if denom > 1 and image.format == "JPEG":  # PIL picks the largest DCT scale that keeps this size
        image.draft("RGB", (-(-width // denom), -(-height // denom)))
    image.load()
    image = image.convert("RGB") if image.mode != "RGB" else image
    sx, sy = image.width / width, image.height / height
    return crop_resize_flip(image, (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy), flip, size)


def write_sample(data: bytes, slot: torch.Tensor, decoder: str, resize: str, augment: Literal["train", "eval"],
                 seed: int, epoch: int, index: int, region: bool = True, reduced_scale: bool = False) -> None:
    """Decode one sample, crop/resize/flip it and write it into `slot` (CHW uint8, e.g. of a batch).
    `resize` torch: only the crop is decoded where it can be (`decode_planned`; `region` False: whole),
    at a reduced DCT scale with `reduced_scale` where the crop is at least twice the slot's size."""
    if resize == "torch":
        pixels, box, flip = decode_planned(data, decoder, augment, seed, epoch, index, region,
                                           slot.shape[-1] if reduced_scale else None)
        crop_resize_flip_into(pixels, box, flip, slot)
    else:
        slot.numpy()[...] = pil_pixels(data, decoder, augment, seed, epoch, index, slot.shape[-1],
                                       reduced_scale).transpose(2, 0, 1)


def to_normalised_chw(pixels: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """HWC uint8 -> CHW float32, (x/255 - mean) / std: what ToTensor + Normalize do."""
    tensor = torch.from_numpy(pixels.transpose(2, 0, 1).astype(np.float32)).div_(255.0)
    mean_t = torch.tensor(mean).view(3, 1, 1)
    std_t = torch.tensor(std).view(3, 1, 1)
    return tensor.sub_(mean_t).div_(std_t)


def normalise_chw(chw: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """CHW uint8 -> CHW float32 normalised, as `to_normalised_chw` does for HWC arrays."""
    return chw.float().div_(255.0).sub_(torch.tensor(mean).view(3, 1, 1)).div_(torch.tensor(std).view(3, 1, 1))


def decoder_name(choice: str) -> str:
    """The decoder `choice` (auto|pil|simplejpeg) resolves to here."""
    if choice == "auto":
        return "simplejpeg" if simplejpeg is not None else "pil"
    return choice
