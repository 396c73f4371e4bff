"""The per-sample image pipeline every backend shares: the crop plan, and decoding a batch's encoded
samples into their slots by it.

loadopt's own equivalents of torchvision's RandomResizedCrop / Resize+CenterCrop / flip /
ToTensor+Normalize (torchvision is optional). Random choices are a hash of (seed, epoch, sample
index) (`sample_uniforms`), so a sample gets the same crop whichever worker or backend decodes it.
The primitives (decoders, boxes, resize kernels) are `loadopt.imaging`'s; this module binds them to the
plan: `write_sample` for one sample, `decode_batch` for a batch (the one loop the `arrow`, `posix` and
`kvikio` backends decode their encoded forms with).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from loadopt.errors import describe_sample_error
from loadopt.imaging import decode
from loadopt.imaging.decode import Encoded, dct_denominator
from loadopt.imaging.geometry import (
    EVAL_CROP_FRACTION,
    UNIFORMS_PER_SAMPLE,
    Box,
    center_crop_box,
    random_resized_crop_box,
    random_resized_crop_boxes,
    whole_pixels,
)
from loadopt.imaging.resize import crop_resize_flip, crop_resize_flip_chw, crop_resize_flip_into

# A batched device JPEG decoder: host bitstreams in, CHW uint8 tensors on the device out (`gpu_jpeg_decoder`).
DeviceDecoder = Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
Failures = list[tuple[int, str]]  # (sample index, why) of the samples that could not be decoded
# The job's own per-sample transform (`sample_transform.SampleTransform`): (HWC uint8 pixels, seed, epoch, sample
# index) -> the pipeline's HWC uint8 pixels; with `augment: none` it is handed the whole decoded image.
PixelTransform = Callable[[np.ndarray, int, int, int], np.ndarray]
Augment = Literal["train", "eval", "none"]


MASK64 = (1 << 64) - 1
GOLDEN64, EPOCH64 = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03  # splitmix64's increment; the epoch's multiplier


def sample_hash(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """64 random bits per sample from (seed, epoch, index), for a whole batch at once (splitmix64):
    per-sample randomness that does not depend on which batch or thread handles the sample."""
    with np.errstate(over="ignore"):
        x = (np.uint64(seed) * np.uint64(GOLDEN64)) ^ (np.uint64(epoch) * np.uint64(EPOCH64))
        x = x ^ indices.astype(np.uint64)
        return mix64(x)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of 64-bit words whose outputs look independent."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, epoch: int, indices: np.ndarray, count: int) -> np.ndarray:
    """(B, count) uniforms in [0, 1) per sample from (seed, epoch, index): splitmix64's sequence from the
    sample's hash, 53 bits each. A batch is drawn in a few vectorised passes (a per-sample seeded
    generator holds the GIL for a whole batch's plan, and left the crop threads of the whole-frame paths
    waiting for it)."""
    with np.errstate(over="ignore"):
        steps = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(GOLDEN64)
        words = mix64(sample_hash(seed, epoch, indices)[:, None] + steps)
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def mix64_int(x: int) -> int:
    """`mix64` of one word in Python integers (the same bits)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def sample_uniform(seed: int, epoch: int, index: int) -> Callable[[int], float]:
    """Column k of `sample_uniforms` for one sample, computed on demand in Python integers (the same
    values: one sample's plan needs only the draws of its first fitting try)."""
    base = mix64_int(((seed * GOLDEN64) & MASK64) ^ ((epoch * EPOCH64) & MASK64) ^ (index & MASK64))
    return lambda k: (mix64_int((base + (k + 1) * GOLDEN64) & MASK64) >> 11) * (1.0 / (1 << 53))


def plan_batch(widths: np.ndarray, heights: np.ndarray, augment: Augment, seed: int, epoch: int,
               indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The crop boxes (B, 4 float64, in source pixels) and flips (B bool) of a batch: `plan` for each
    sample, computed together (the same arithmetic, so the same values)."""
    widths, heights = np.asarray(widths, np.int64), np.asarray(heights, np.int64)
    if augment == "none":  # no crop: the whole frame
        zeros = np.zeros(len(widths))
        return np.stack([zeros, zeros, widths, heights], axis=1).astype(np.float64), np.zeros(len(widths), bool)
    if augment == "eval":
        side = np.minimum(widths, heights) * EVAL_CROP_FRACTION
        left, top = (widths - side) / 2, (heights - side) / 2
        return np.stack([left, top, left + side, top + side], axis=1), np.zeros(len(widths), bool)
    uniforms = sample_uniforms(seed, epoch, np.asarray(indices), UNIFORMS_PER_SAMPLE + 1)
    boxes = random_resized_crop_boxes(widths, heights, uniforms).astype(np.float64)
    return boxes, uniforms[:, UNIFORMS_PER_SAMPLE] < 0.5


def plan(width: int, height: int, augment: Augment, seed: int, epoch: int,
         index: int) -> tuple[Box, bool]:
    """The crop box (in source pixels) and whether to flip, for one sample (torchvision's
    RandomResizedCrop + horizontal flip for train, the centre crop for eval); `plan_batch` for one."""
    if augment == "none":  # no crop: the whole frame
        return (0.0, 0.0, float(width), float(height)), False
    if augment == "eval":
        return center_crop_box(width, height), False
    uniform = sample_uniform(seed, epoch, int(index))
    return random_resized_crop_box(width, height, uniform), uniform(UNIFORMS_PER_SAMPLE) < 0.5


def decoder_name(choice: str) -> str:
    """The decoder a backend's `decoder` setting (auto|pil|simplejpeg) resolves to here."""
    if choice == "auto":
        return "simplejpeg" if decode.simplejpeg is not None else "pil"
    return choice


def decode_planned(data: Encoded, decoder: str, augment: Augment, seed: int, epoch: int,
                   index: int, region: bool = True, reduced_for: int | None = None) -> tuple[np.ndarray, Box, bool]:
    """Decode what one sample's crop needs: (HWC uint8 pixels, the crop box in their coordinates, flip);
    only the crop's region of a JPEG where it can (`imaging.decode.decode_for_crop`)."""
    return decode.decode_for_crop(data, decoder, lambda width, height: plan(width, height, augment, seed, epoch, index),
                                  region, reduced_for)


def pil_pixels(data: Encoded, decoder: str, augment: Augment, seed: int, epoch: int, index: int,
               size: int, reduced_scale: bool = False, transform: PixelTransform | None = None) -> np.ndarray:
    """Decode one sample and crop/resize/flip it with PIL's kernel: HWC uint8. `reduced_scale`: a crop
    at least twice `size` decoded at a reduced DCT scale (`decode_planned`; PIL's `draft` for `pil`).
    `transform`: the job's own, run on the result (`augment: none`: on the whole decoded image instead)."""
    if augment == "none":
        if transform is None:
            raise ValueError("augment: none leaves the crop to the job's transform, and there is none")
        return transform(decode.decode_array(data, decoder), seed, epoch, index)
    if transform is not None:
        return transform(pil_pixels(data, decoder, augment, seed, epoch, index, size, reduced_scale),
                         seed, epoch, index)
    if reduced_scale and decoder != "pil":
        pixels, box, flip = decode_planned(data, decoder, augment, seed, epoch, index, True, size)
        return crop_resize_flip(Image.fromarray(pixels), box, flip, size)
    if not reduced_scale:
        image = decode.decode_pil(data) if decoder == "pil" else decode.decode_fast(data)
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


def write_sample(data: Encoded, slot: torch.Tensor, decoder: str, resize: str, augment: Augment,
                 seed: int, epoch: int, index: int, region: bool = True, reduced_scale: bool = False,
                 transform: PixelTransform | None = None) -> None:
    """Decode one sample, crop/resize/flip it and write it into `slot` (CHW uint8, e.g. of a batch).
    `resize` torch: only the crop is decoded where it can be (`decode_planned`; `region` False: whole),
    at a reduced DCT scale with `reduced_scale` where the crop is at least twice the slot's size.
    `transform`: the job's own, run on the crop (`augment: none`: on the whole decoded image, no crop)."""
    if augment == "none":
        if transform is None:
            raise ValueError("augment: none leaves the crop to the job's transform, and there is none")
        slot.numpy()[...] = transform(decode.decode_array(data, decoder), seed, epoch, index).transpose(2, 0, 1)
        return
    if transform is not None:
        write_sample(data, slot, decoder, resize, augment, seed, epoch, index, region, reduced_scale)
        chw = slot.numpy()
        chw[...] = transform(chw.transpose(1, 2, 0).copy(), seed, epoch, index).transpose(2, 0, 1)
        return
    if resize == "torch":
        pixels, box, flip = decode_planned(data, decoder, augment, seed, epoch, index, region,
                                           slot.shape[-1] if reduced_scale else None)
        crop_resize_flip_into(pixels, box, flip, slot)
    else:
        slot.numpy()[...] = pil_pixels(data, decoder, augment, seed, epoch, index, slot.shape[-1],
                                       reduced_scale).transpose(2, 0, 1)


def decode_batch(slot: torch.Tensor, indices: np.ndarray, sample: Callable[[int], Any],
                 decoder: str | DeviceDecoder, augment: Augment, seed: int, epoch: int, *,
                 reduced_scale: bool = False, pool: Executor | None = None, threads: int = 1,
                 damaged: Callable[[int], None] | None = None, transform: PixelTransform | None = None) -> Failures:
    """Decode each encoded sample of a batch into its slot by the shared plan: batch position k (sample
    `indices[k]`, bytes `sample(k)`) cropped, resized and flipped into `slot[k]` (`slot` a batch ring's
    slot: (B, size, size, 3) uint8, each position written through its CHW view). Returns the
    samples that could not be decoded, for the consumer's `on_error` policy (their slots hold garbage);
    `damaged(index)` is called first for each of them, to raise when the stored form itself is damaged
    (not the source's fault).

    `decoder` a CPU decoder's name (`decoder_name`): each sample decoded on the host (`write_sample`,
    torch's kernel, the region decode and `reduced_scale` as configured), the positions split over
    `threads` threads of `pool` (decoding and resizing release the GIL). A `DeviceDecoder`: the batch's
    bitstreams decoded in one call onto the slot's device (a failing batch again sample by sample, to
    name the bad ones), each image then cropped there (`crop_resize_flip_chw`), in the calling thread."""
    n = len(indices)
    if slot.dim() != 4 or slot.shape[-1] != 3:
        raise ValueError(f"decode_batch writes into a ring slot of HWC positions (B, size, size, 3), "
                         f"not {tuple(slot.shape)}")
    slots = slot.permute(0, 3, 1, 2)  # CHW views of the HWC positions
    if callable(decoder):
        if transform is not None or augment == "none":
            raise ValueError("a job's own transform runs on host-decoded samples, not a device decoder's")
        device_decode, device = decoder, slot.device
        streams = [sample(k) for k in range(n)]
        try:
            images: list[torch.Tensor] | None = list(device_decode(streams, device))
        except Exception:  # noqa: BLE001 - the culprits are found sample by sample below
            images = None
        if images is not None and len(images) != n:
            images = None

        def write(k: int, index: int) -> None:
            chw = images[k] if images is not None else device_decode([streams[k]], device)[0]
            box, flip = plan(chw.shape[2], chw.shape[1], augment, seed, epoch, index)
            crop_resize_flip_chw(chw, box, flip, slots[k])
    else:
        name = decoder

        def write(k: int, index: int) -> None:
            write_sample(sample(k), slots[k], name, "torch", augment, seed, epoch, index, reduced_scale=reduced_scale,
                         transform=transform)

    def run(positions: Iterable[int]) -> Failures:
        failures = []
        for k in positions:
            index = int(indices[k])
            try:
                write(int(k), index)
            except Exception as exc:  # noqa: BLE001 - reported by policy in the consumer
                if damaged is not None:
                    damaged(index)
                failures.append((index, f"{describe_sample_error(exc)} (sample {index})"))
        return failures

    if pool is None or callable(decoder) or n == 0:
        return run(range(n))
    chunks = np.array_split(np.arange(n), min(threads, n))
    return [failure for chunk in pool.map(run, chunks) for failure in chunk]


def to_normalised_chw(pixels: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """HWC uint8 -> CHW float32, (x/255 - mean) / std: what ToTensor + Normalize do."""
    tensor = torch.from_numpy(pixels.transpose(2, 0, 1).astype(np.float32)).div_(255.0)
    mean_t = torch.tensor(mean).view(3, 1, 1)
    std_t = torch.tensor(std).view(3, 1, 1)
    return tensor.sub_(mean_t).div_(std_t)


def normalise_chw(chw: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """CHW uint8 -> CHW float32 normalised, as `to_normalised_chw` does for HWC arrays."""
    return chw.float().div_(255.0).sub_(torch.tensor(mean).view(3, 1, 1)).div_(torch.tensor(std).view(3, 1, 1))
