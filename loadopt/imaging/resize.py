"""Crop, resize (bilinear, antialiased) and flip: PIL's kernel on PIL images, torch's uint8 kernel on
views of decoded arrays, its float kernel on device tensors.

PIL's (`resize(box=...)`) is what torchvision does on PIL images; torch's uint8 kernel on a view of the
decoded array is what torchvision v2 does on tensors: several times cheaper, no PIL<->numpy copies;
pixels differ from PIL's by rounding, mean |diff| < 0.1 of a level.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from loadopt.imaging.geometry import Box, whole_pixels

try:  # a 16-pixel SIMD row mirror, built at install where a C compiler is
    from loadopt import _native as native
except ImportError:  # pragma: no cover - built by `pip install`; OpenCV's mirror, else a copy, stands in
    native = None  # type: ignore[assignment]  # None where the optional module is absent

try:  # OpenCV's mirror, where the user has OpenCV (the `opencv` extra): used where the native module is not built
    import cv2
except ImportError:
    cv2 = None  # type: ignore[assignment]  # None where the optional module is absent

# Whether a resized crop can be mirrored where it lies (else the flip is one reversed strided copy into its slot).
MIRROR_IN_PLACE = native is not None or cv2 is not None


def mirror_in_place(pixels: np.ndarray) -> None:
    """Mirror C-contiguous HWC uint8 pixels left-right where they lie: the native module's row mirror (8 us for
    224 px), else OpenCV's (4 us), else a reversed copy."""
    if native is not None:
        native.mirror(pixels, pixels.shape[0], pixels.shape[1])
    elif cv2 is not None:
        cv2.flip(pixels, 1, dst=pixels)
    else:
        pixels[...] = pixels[:, ::-1].copy()


def crop_resize_flip(image: Image.Image, box: Box, flip: bool, size: int) -> np.ndarray:
    """The crop, resized to size x size (PIL's bilinear, antialiased) and flipped: HWC uint8."""
    out = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def resize_aa(crop: torch.Tensor, size: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """torch's antialiased bilinear resize of an NCHW batch (uint8 on the CPU: its integer kernel), as
    `F.interpolate(..., mode="bilinear", antialias=True)` computes it (the binding it calls: `torch.ops`'
    dispatch costs several times its Python overhead), optionally written into `out`."""
    if out is None:
        # torch's stub lists only the (input, output_size, align_corners, scale_factors) overload of this binding
        return torch._C._nn._upsample_bilinear2d_aa(crop, size, False, None, None)  # type: ignore[call-arg]
    return torch._C._nn._upsample_bilinear2d_aa(crop, size, False, None, None, out=out)  # type: ignore[call-arg]


def crop_resize_flip_into(pixels: np.ndarray, box: Box, flip: bool, out: torch.Tensor,
                          fused: bool = True) -> None:
    """The crop of an HWC uint8 array, resized with torch's uint8 antialiased bilinear kernel and
    flipped, written into `out` (CHW-shaped uint8: a slot of a batch, or the CHW view of an HWC one).

    `fused` (the default): an unflipped crop is resized straight into `out`; a flipped one too where
    `out` is a view of HWC pixels (every batch ring's layout), then mirrored there in place
    (`mirror_in_place`); elsewhere resized into a new tensor and mirrored into `out` by
    one reversed strided copy. The same pixels as resizing into a new tensor, flipping that (a copy)
    and copying it into `out`, which `fused` False does (benchmarks/levers.py). The kernel reads the HWC
    crop as channels-last, so an HWC `out` takes its output as computed, where CHW memory costs the
    kernel a transposing write."""
    left, top, right, bottom = whole_pixels(box)  # torch's kernel takes whole-pixel crops
    crop = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)[:, :, top:bottom, left:right]
    size = list(out.shape[-2:])
    hwc_out = out.permute(1, 2, 0)
    if fused and (not flip or (MIRROR_IN_PLACE and out.device.type == "cpu" and hwc_out.is_contiguous())):
        resize_aa(crop, size, out.unsqueeze(0))
        if flip:
            mirror_in_place(hwc_out.numpy())
        return
    resized = resize_aa(crop, size)[0]
    if fused and out.device.type == "cpu":  # one strided copy, no flipped temporary
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
