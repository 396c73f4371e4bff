"""The shared image primitives' levers deliver the same pixels as the plain paths they replace:
region decoding (loadopt/_jpeg.c) equals the full decode's crop, the fused resize equals resize,
flip, copy; reduced-scale decoding stays near the full decode's crop (its pixels differ by design)."""

import io

import cv2
import numpy as np
import pytest
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

from loadopt.imaging import decode, geometry, resize
from loadopt.loaders import transforms

needs_region = pytest.mark.skipif(decode.jpeg_region is None,
                                  reason="loadopt._jpeg not built (libjpeg-turbo headers missing at install)")
SAMPLINGS = {"4:4:4": 0x111111, "4:2:2": 0x211111, "4:2:0": 0x221111, "4:1:1": 0x411111}


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Smooth colour ramps plus noise: chroma that changes from pixel to pixel, so an edge pixel
    upsampled without its neighbour would differ."""
    rng = np.random.default_rng(seed)
    x, y = np.meshgrid(np.linspace(0, 1, width), np.linspace(0, 1, height))
    base = np.stack([200 * x, 200 * y, 100 + 80 * np.sin(9 * x * y)], -1) + rng.normal(0, 25, (height, width, 3))
    return np.clip(base, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, sampling: str = "4:2:0", progressive: bool = False) -> bytes:
    ok, data = cv2.imencode(".jpg", pixels[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90,
                                                          cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive),
                                                          cv2.IMWRITE_JPEG_SAMPLING_FACTOR, SAMPLINGS[sampling]])
    assert ok
    return data.tobytes()


@needs_region
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("progressive", [False, True])
def test_a_decoded_region_equals_the_full_decodes_crop(sampling, progressive):
    data = encode(photo(517, 333), sampling, progressive)
    full = simplejpeg.decode_jpeg(data, colorspace="RGB")
    assert decode.jpeg_region.header(data) == (517, 333)
    rng = np.random.default_rng(1)
    boxes = [(0, 0, 517, 333), (1, 1, 2, 2), (16, 16, 200, 100), (15, 17, 300, 250), (200, 100, 517, 333)]
    boxes += [tuple(int(v) for v in (*lt, *(lt + rng.integers(1, 200, 2)))) for lt in rng.integers(0, 300, (20, 2))]
    for left, top, right, bottom in boxes:
        right, bottom = min(right, 517), min(bottom, 333)
        region = decode.jpeg_region.decode_region(data, 1, left, top, right, bottom)
        got = np.frombuffer(region, np.uint8).reshape(bottom - top, right - left, 3)
        assert np.array_equal(got, full[top:bottom, left:right]), (left, top, right, bottom)


@needs_region
def test_the_region_decoder_refuses_bad_input_with_a_value_error():
    data = encode(photo(64, 48))
    cases = [(b"", (0, 0, 8, 8)), (b"\xff\xd8 not a jpeg", (0, 0, 8, 8)), (data[: len(data) // 3], (0, 0, 64, 48)),
             (data, (0, 0, 65, 48)), (data, (5, 5, 5, 9))]  # empty, garbage, truncated, outside, empty box
    for bad, box in cases:
        with pytest.raises(ValueError):
            decode.jpeg_region.decode_region(bad, 1, *box)


@pytest.mark.parametrize("augment", ["train", "eval"])
def test_write_sample_is_the_same_with_and_without_region_decoding(augment):
    """The JPEG path's whole output: region decoding (and the fused resize) change no pixel, also for
    a greyscale JPEG and a PNG (decoded whole)."""
    grey = io.BytesIO()
    Image.fromarray(photo(300, 200)[..., 0]).save(grey, format="JPEG", quality=90)
    png = io.BytesIO()
    Image.fromarray(photo(120, 90)).save(png, format="PNG")
    samples = [encode(photo(400 + 13 * i, 300 - 7 * i, i)) for i in range(6)] + [grey.getvalue(), png.getvalue()]
    for index, data in enumerate(samples):
        fast, plain = (torch.empty(3, 96, 96, dtype=torch.uint8) for _ in range(2))
        transforms.write_sample(data, fast, "simplejpeg", "torch", augment, 5, 2, index)
        transforms.write_sample(data, plain, "simplejpeg", "torch", augment, 5, 2, index, region=False)
        assert torch.equal(fast, plain), index


def test_the_fused_resize_equals_resize_flip_copy():
    """Into a CHW slot and into a CHW view of an HWC batch (the decoded paths'), flipped or not."""
    pixels = photo(333, 250)
    hwc = torch.zeros(4, 64, 64, 3, dtype=torch.uint8)
    for slots in (torch.zeros(4, 3, 64, 64, dtype=torch.uint8), hwc.permute(0, 3, 1, 2)):
        for k, (box, flip) in enumerate([((0, 0, 333, 250), False), ((10, 20, 200, 150), True),
                                         ((3.4, 5.6, 100.2, 77.7), True), ((50, 50, 90, 70), False)]):
            left, top, right, bottom = geometry.whole_pixels(box)
            crop = torch.from_numpy(pixels).permute(2, 0, 1)[None, :, top:bottom, left:right]
            want = F.interpolate(crop, size=(64, 64), mode="bilinear", antialias=True, align_corners=False)[0]
            resize.crop_resize_flip_into(pixels, box, flip, slots[k])
            assert torch.equal(slots[k], want.flip(-1) if flip else want), (k, box, flip)


def test_the_dct_denominator_keeps_the_crop_at_least_the_output_size():
    assert decode.dct_denominator((0, 0, 447, 900), 224) == 1
    assert decode.dct_denominator((10, 10, 458, 458), 224) == 2
    assert decode.dct_denominator((0, 0, 1800, 900), 224) == 4
    assert decode.dct_denominator((0, 0, 1792, 1792), 224) == 8


@needs_region
def test_reduced_scale_decoding_stays_near_the_exact_pixels():
    """Its pixels differ by design (the DCT's downscale, then the resize): close to the exact path's,
    and the exact path where the crop is under twice the output."""
    data = encode(photo(1200, 900))
    differences = []
    for index in range(8):
        reduced, exact = (torch.empty(3, 96, 96, dtype=torch.uint8) for _ in range(2))
        transforms.write_sample(data, reduced, "simplejpeg", "torch", "train", 0, 0, index, reduced_scale=True)
        transforms.write_sample(data, exact, "simplejpeg", "torch", "train", 0, 0, index)
        box, _ = transforms.plan(1200, 900, "train", 0, 0, index)
        if decode.dct_denominator(geometry.whole_pixels(box), 96) == 1:
            assert torch.equal(reduced, exact), index
        differences.append((reduced.float() - exact.float()).abs().mean().item())
    print("mean |reduced - exact| per sample, levels:", [round(d, 2) for d in differences])
    assert max(differences) < 4


@pytest.mark.parametrize("decoder", ["pil", "simplejpeg"])
def test_the_pil_path_reduces_the_scale_too(decoder):
    """torch plain (PIL's resize) honours `reduced_scale` as the torch-kernel paths do (its recipe says so):
    near the exact pixels where the crop is at least twice the output, equal where it is not."""
    data = encode(photo(1200, 900))
    reduced_any = False
    for index in range(6):
        box, _ = transforms.plan(1200, 900, "train", 0, 0, index)
        reduced = transforms.pil_pixels(data, decoder, "train", 0, 0, index, 96, reduced_scale=True)
        exact = transforms.pil_pixels(data, decoder, "train", 0, 0, index, 96)
        difference = np.abs(reduced.astype(float) - exact).mean()
        if decode.dct_denominator(geometry.whole_pixels(box), 96) == 1:
            assert decoder == "simplejpeg" or np.array_equal(reduced, exact), index
        else:
            reduced_any = True
        assert difference < 4, (index, difference)
    assert reduced_any


def test_decode_batch_writes_each_sample_as_write_sample_does_and_names_the_bad_ones():
    """The backends' one per-sample loop: over a pool's threads, every good sample's slot equals
    `write_sample`'s, a corrupt one is reported by index (after `damaged` saw it), the rest unharmed."""
    from concurrent.futures import ThreadPoolExecutor

    samples = [encode(photo(300 + 11 * i, 200 + 7 * i, i)) for i in range(7)]
    samples[3] = samples[3][: len(samples[3]) // 4]  # truncated: no decoder can read it
    indices = np.arange(100, 107)
    slot = torch.zeros(7, 64, 64, 3, dtype=torch.uint8)  # a ring slot: HWC positions
    damaged: list[int] = []
    with ThreadPoolExecutor(3) as pool:
        failures = transforms.decode_batch(slot, indices, lambda k: memoryview(samples[k]), "simplejpeg", "train",
                                           5, 1, pool=pool, threads=3, damaged=damaged.append)
    assert [index for index, _ in failures] == [103] and damaged == [103]
    assert "sample 103" in failures[0][1]
    for k in (0, 1, 2, 4, 5, 6):
        want = torch.empty(3, 64, 64, dtype=torch.uint8)
        transforms.write_sample(samples[k], want, "simplejpeg", "torch", "train", 5, 1, int(indices[k]))
        assert torch.equal(slot[k].permute(2, 0, 1), want), k


def test_decode_batch_with_a_device_decoder_finds_the_bad_sample_one_by_one():
    """A batched decoder that fails the whole batch: each sample decoded again alone, the bad one named,
    the others cropped as the CPU path crops them (torch's uint8 kernel on the CPU: equal pixels)."""
    from loadopt.imaging.decode import decode_array

    samples = [encode(photo(280 + 9 * i, 190 + 5 * i, i)) for i in range(4)]
    samples[1] = b"\xff\xd8 not a jpeg"
    calls = []

    def batched(streams, device):
        calls.append(len(streams))
        return [torch.from_numpy(decode_array(bytes(s.numpy()), "simplejpeg")).permute(2, 0, 1) for s in streams]

    indices = np.arange(4)
    slot = torch.zeros(4, 48, 48, 3, dtype=torch.uint8)
    streams = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in samples]
    failures = transforms.decode_batch(slot, indices, lambda k: streams[k], batched, "eval", 0, 0)
    assert calls == [4, 1, 1, 1, 1]  # the batch, then sample by sample
    assert [index for index, _ in failures] == [1]
    for k in (0, 2, 3):
        want = torch.empty(3, 48, 48, dtype=torch.uint8)
        transforms.write_sample(samples[k], want, "simplejpeg", "torch", "eval", 0, 0, k, region=False)
        assert torch.equal(slot[k].permute(2, 0, 1), want), k


@pytest.mark.parametrize("augment", ["train", "eval"])
def test_a_batch_plan_equals_each_samples_plan_to_the_bit(augment):
    """`plan_batch` (numpy, the whole-frame paths) and `plan` (plain Python, the JPEG paths) give every
    sample the same box and flip, including degenerate sizes where no try fits (the clamped centre)."""
    rng = np.random.default_rng(5)
    widths, heights = rng.integers(1, 5000, 3000), rng.integers(1, 5000, 3000)
    widths[:20], heights[20:40], heights[40:60] = 1, 1, 2  # extreme aspect ratios: the fallback box
    indices = rng.integers(0, 2**40, 3000)
    for seed, epoch in [(0, 0), (11, 3), (2**31, 977)]:
        boxes, flips = transforms.plan_batch(widths, heights, augment, seed, epoch, indices)
        for k in range(0, 3000, 3):
            box, flip = transforms.plan(int(widths[k]), int(heights[k]), augment, seed, epoch, int(indices[k]))
            assert tuple(boxes[k]) == tuple(float(v) for v in box) and bool(flips[k]) == flip, (k, seed, epoch)


def test_the_train_plan_draws_random_resized_crop_s_ranges():
    """Areas within RandomResizedCrop's (0.08, 1) of the image, aspect ratios within (3/4, 4/3), boxes
    inside the image, half the samples flipped, and a new draw for a new epoch."""
    boxes, flips = transforms.plan_batch(np.full(4000, 640), np.full(4000, 480), "train", 1, 0, np.arange(4000))
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    area = widths * heights / (640 * 480)
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= 640).all() and (boxes[:, 3] <= 480).all()
    assert area.min() > 0.07 and area.max() <= 1.0 and 0.4 < area.mean() < 0.6
    assert ((widths / heights) > 0.74).all() and ((widths / heights) < 1.35).all()
    assert 0.45 < flips.mean() < 0.55
    again, _ = transforms.plan_batch(np.full(4000, 640), np.full(4000, 480), "train", 1, 1, np.arange(4000))
    assert (again != boxes).any(axis=1).mean() > 0.95
