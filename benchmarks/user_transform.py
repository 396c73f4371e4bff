"""What a job's own per-sample transform costs on each path, against the transform alone in worker processes.

The job: the config's dataset (the synthetic ImageNet-shaped JPEGs by default) under loadopt's RandomResizedCrop +
flip, then `rand_ops` below, a RandAugment-style transform as torchvision's and timm's are written (two operations
drawn with Python's `random` from PIL's ImageEnhance/ImageOps, their magnitudes from NumPy's generator) on the
224 px crop. Each path runs through the harness (step time 0, loader-bound) with the transform and without it, the
two interleaved in every round (the order alternating); the transform's cost on a path is the time per sample it
adds there, 1/rate_with - 1/rate_without. Its ceiling is the transform alone (on crops made beforehand, seeded per
sample as the paths seed it) in as many worker processes as the machine has usable cores
(`bench.attribution.parallel.rate_in_workers`), measured in the same round. dali's run without the transform would
decode with DALI's own engine, another path: its reference run is the transform's path (DALI's Python operator
feeding loadopt's workers) with a transform that changes nothing (`unchanged`, handed the decoded array).
The figure per path is the ceiling's
time per sample over the path's cost: 1.0 when the path runs the transform as fast as processes running nothing
else can, lower where it serialises it (threads of one process take turns: its generators are the process's).

Prints per path `RESULT user_transform_<path>_of_ceiling ratio=<median over rounds> target>=0.8`.

    python benchmarks/user_transform.py [--config configs/imagenet.yaml] [--rounds 5] [--batches 40]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import numpy as np
from _common import REPO, build_loader, harness_run, ratio_result, spread
from PIL import Image, ImageEnhance, ImageOps

from loadopt.bench.attribution.parallel import rate_in_workers
from loadopt.config import load_config
from loadopt.loaders import transforms
from loadopt.loaders.sample_transform import SampleTransform
from loadopt.machine import usable_cores
from loadopt.storage.open import open_dataset

OPERATIONS = (
    lambda image, m: ImageEnhance.Color(image).enhance(0.1 + 1.8 * m),
    lambda image, m: ImageEnhance.Contrast(image).enhance(0.1 + 1.8 * m),
    lambda image, m: ImageEnhance.Sharpness(image).enhance(0.1 + 1.8 * m),
    lambda image, m: ImageEnhance.Brightness(image).enhance(0.1 + 1.8 * m),
    lambda image, m: ImageOps.posterize(image, 4 + int(4 * m)),
    lambda image, m: ImageOps.solarize(image, int(256 * m)),
    lambda image, m: image.rotate(30 * (2 * m - 1), resample=Image.BILINEAR),
    lambda image, m: ImageOps.autocontrast(image),
    lambda image, m: ImageOps.equalize(image),
)


def rand_ops(image: Image.Image) -> Image.Image:
    """RandAugment(num_ops=2) in the shape torchvision writes it: the operations drawn with `random`, their
    magnitudes with NumPy's generator."""
    for operation in random.sample(OPERATIONS, 2):
        image = operation(image, float(np.random.uniform()))
    return image


def unchanged(pixels: np.ndarray) -> np.ndarray:
    """A transform that changes nothing: dali's reference run, on the path a transform takes."""
    return pixels


# The paths that run a per-sample transform: (label, backend, settings), their parallelism the usable cores.
def paths(cores: int) -> list[tuple[str, str, dict]]:
    return [("torch_tuned", "torch", {"variant": "tuned", "num_workers": cores}),
            ("arrow_encoded", "arrow", {"form": "encoded", "threads": cores, "crop_in": "processes"}),
            ("posix_encoded", "posix", {"form": "encoded", "threads": cores}),
            ("dali_external", "dali", {"reader": "external", "num_threads": cores})]


def transform_alone_rate(crops: list[np.ndarray], transform: SampleTransform, seed: int, epoch: int, workers: int,
                         seconds: float) -> float:
    """Samples/s of the transform alone on crops made beforehand, in `workers` forked processes. Each call is
    seeded as sample i of the epoch (its own draws: which operations, their magnitudes), over the crops in turn:
    the operations' mix is the paths' (a few samples' draws repeated would weigh a few operations)."""
    count = len(crops)

    def work(i: int) -> None:
        transform(crops[i % count].copy(), seed, epoch, i)

    return rate_in_workers(work, workers, seconds)["samples_per_s"]


def work_alone_rate(blobs: list[bytes], transform: SampleTransform, seed: int, epoch: int, workers: int,
                    seconds: float) -> float:
    """Samples/s of a sample's whole work alone (decode, crop, the transform) from memory, in `workers` forked
    processes: what bounds every path's `with` run, whatever its own decoder does without the transform."""
    count, size = len(blobs), transform.size
    slot = transforms.torch.empty((size, size, 3), dtype=transforms.torch.uint8).permute(2, 0, 1)

    def work(i: int) -> None:
        transforms.write_sample(blobs[i % count], slot, "simplejpeg", "torch", "train", seed, epoch, i,
                                transform=transform)

    return rate_in_workers(work, workers, seconds)["samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--ceiling-seconds", type=float, default=3.0)
    parser.add_argument("--paths", default="", help="comma-separated labels to run (default: every path)")
    args = parser.parse_args()

    config = load_config(args.config)
    config.pipeline.transform = "user_transform:rand_ops"
    pipeline, seed, cores = config.pipeline, config.seed, usable_cores()
    transform = SampleTransform(rand_ops, pipeline.transform, pipeline.image_size, pipeline.transform_input)
    dataset = open_dataset(config)
    crops, blobs = [], [dataset.read(index) for index in range(256)]
    for index in range(256):
        pixels = np.empty((pipeline.image_size, pipeline.image_size, 3), np.uint8)
        transforms.write_sample(dataset.read(index), transforms.torch.from_numpy(pixels).permute(2, 0, 1),
                                "simplejpeg", "torch", "train", seed, 0, index)
        crops.append(pixels)
    print(f"{len(dataset)} samples, {pipeline.image_size} px, {cores} usable cores, load {os.getloadavg()[0]:.1f}",
          flush=True)

    chosen = [p for p in paths(cores) if not args.paths or p[0] in args.paths.split(",")]
    ratios: dict[str, list[float]] = {label: [] for label, _, _ in chosen}
    rates: dict[tuple[str, bool], list[float]] = {}
    ceilings: list[float] = []
    whole: list[float] = []
    for round_index in range(args.rounds):
        ceiling = transform_alone_rate(crops, transform, seed, round_index, cores, args.ceiling_seconds)
        ceilings.append(ceiling)
        whole.append(work_alone_rate(blobs, transform, seed, round_index, cores, args.ceiling_seconds))
        for label, backend, settings in chosen:
            measured = {}
            for with_transform in (round_index % 2 == 0, round_index % 2 == 1):
                # dali without a transform decodes with its own engine: its reference run keeps the path the
                # transform takes (loadopt's workers) with a transform that changes nothing, on the array as decoded
                same_path = backend == "dali" and not with_transform
                loader = build_loader(config if with_transform or same_path else load_config(args.config), backend,
                                      **settings)
                if with_transform:
                    loader.sample_transform = transform
                elif same_path:
                    loader.sample_transform = SampleTransform(unchanged, "user_transform:unchanged",
                                                              pipeline.image_size, "array")
                result = harness_run(loader, args.batches, epoch=round_index)
                measured[with_transform] = result.metrics["samples_per_s"]
                rates.setdefault((label, with_transform), []).append(measured[with_transform])
            cost = 1.0 / measured[True] - 1.0 / measured[False]
            ratios[label].append((1.0 / ceiling) / cost if cost > 0 else float("inf"))
        print(f"round {round_index + 1}: transform alone {ceiling:,.0f}/s; " + "; ".join(
            f"{label} {rates[(label, True)][-1]:,.0f}/s with, {rates[(label, False)][-1]:,.0f}/s without"
            for label, _, _ in chosen) + f" (load {os.getloadavg()[0]:.1f})", flush=True)

    print(f"transform alone in {cores} processes: {spread(ceilings, ',.0f')} samples/s; a sample's whole work (decode, "
          f"crop, transform) alone: {spread(whole, ',.0f')} samples/s")
    for label, _, _ in chosen:
        with_, without = rates[(label, True)], rates[(label, False)]
        cost_ms = statistics.median(1 / a - 1 / b for a, b in zip(with_, without, strict=True)) * 1e3
        of_whole = [a / b for a, b in zip(with_, whole, strict=True)]
        print(f"{label}: with {spread(with_, ',.0f')}; without {spread(without, ',.0f')}; the transform's cost "
              f"{cost_ms:.3f} ms/sample against {1e3 / statistics.median(ceilings):.3f} ms alone; with it, "
              f"{statistics.median(of_whole):.2f} of the whole work's rate alone")
    lines = [ratio_result(f"user_transform_{label}_of_ceiling", ratios[label], ">=", 0.8) for label, _, _ in chosen]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
