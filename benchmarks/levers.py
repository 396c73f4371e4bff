"""Each lever of loadopt's image paths measured alone: the work with it against the same work without it,
side by side in every round (rounds interleaved, the order alternated), held on the median ratio.

The work is the per-sample pipeline the loaders run (`loadopt.loaders.transforms` / `crops` over the
`loadopt.imaging` primitives), on the config's first `--samples` images held in memory (no storage in
the figure), spread over `--threads` threads (the decode and the resize release the GIL, as in the
loaders' threads), in images/s:
- lever_region_decode: the JPEG path (decode, crop plan, resize into the slot, flip) decoding only the
  crop's rows and columns (`loadopt/_jpeg.c`) against decoding the whole image (simplejpeg). Same pixels.
- lever_reduced_scale: the same with the crop decoded at a reduced DCT scale where it is at least twice
  the output each way, against scale 1 (both decoding only the crop). Other pixels: the share of
  samples it applies to and the mean |difference| in levels are printed.
- lever_fused_resize: the decoded whole-frame paths' crop + resize + flip (`crops.crop_frames` on frames
  stored as the decoded forms store them) resizing straight into the batch's HWC slot (a flipped crop into
  an HWC scratch, mirrored into its slot by OpenCV), against resize into a new tensor, flip (a copy), copy
  into the slot. Same pixels. It was 1.08 (spread 0.995-1.26): torch's kernel returns a new tensor as NCHW
  (~290 us against ~190 us into an HWC target, 224 px) and the flipped crops, half of them, then paid a
  transposing copy as the unfused path does; since, 1.73 (spread 1.15-1.89; per CPU second 1.76, 1.69-1.82),
  1.9 and 1.65 at load averages of 10-11.
- lever_hwc_slot: the JPEG path writing each crop into an HWC slot (every batch ring's layout since issue
  19's second pass: torch's kernel reads the HWC crop as channels-last and writes that as computed, a flip
  mirrored in place by OpenCV), and each batch of them finished as the emulated device finishes it
  (`device.finish_inputs` into channels-last float: no transpose), against CHW slots (the kernel's output
  transposed into them; a flipped crop resized into a new tensor first) finished from NCHW (a uint8
  transpose first). Same pixels; the lever is the layout, which both ends of the batch pay for.
- lever_restart_markers: the JPEG path (region decode, fused resize) on the encoded forms' stored JPEGs
  (`imaging.reencode.with_restarts`: the same coefficients with restart markers that tile each MCU row, so
  the region decoder reads the intervals around the crop only) against the sources' own bytes. Same pixels.
- lever_jpeg_path: every JPEG-path lever that is on by default (region decode + fused resize + HWC slot)
  against none (the sources' bytes in each: restart markers are the stored forms' lever).
- lever_region_decode_loader (with `--loader-batches N`): the same lever end to end, the `torch` tuned
  loader (2 worker processes) in the harness, step time 0, with region decoding against without it
  (the module switched off before the workers fork): the rate a training loop sees.
Shown beside them (not levers loadopt applies): OpenCV's INTER_AREA resize against torch's antialiased
bilinear kernel on the same crops (another kernel, other pixels).

Each RESULT is `with / without` in images/s, target >= 1.1 (a lever worth its code gains 10%; reduced scale
is held only where it acts on at least a quarter of the samples, i.e. large photos). The
machine is shared (other agents run beside it): the spread is printed, and beside each the ratio of
images per CPU second of this process (all threads; the loader: the harness's CPU seconds), which
another process's load disturbs far less than the wall-clock rate: the work the lever saves.

    python benchmarks/levers.py [--config configs/imagenet.yaml] [--rounds 5] [--samples 256] [--threads 2]
    python benchmarks/levers.py --config configs/photos_large.yaml --samples 48
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import _common  # noqa: F401 - puts the repo on sys.path
import numpy as np
import torch
from _common import ratio_result, spread

TARGET = 1.1
REDUCED_SHARE_HELD = 0.25  # the share of samples reduced-scale decoding must act on to be held to TARGET


def cpu_seconds() -> float:
    """CPU time of this process, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_rate(work, count: int, pool: ThreadPoolExecutor, threads: int) -> tuple[float, float]:
    """(images/s, images per CPU second) of `work(positions)` over `count` samples split across `threads`
    threads."""
    chunks = [c for c in np.array_split(np.arange(count), threads) if len(c)]
    start, cpu = time.perf_counter(), cpu_seconds()
    list(pool.map(work, chunks))
    return count / (time.perf_counter() - start), count / max(cpu_seconds() - cpu, 1e-9)


def one_thread_each() -> None:
    """The loaders' resize threads run one intra-op thread each (crops.ONE_TORCH_THREAD_EACH)."""
    torch.set_num_threads(1)


def main() -> int:
    from loadopt.config import load_config
    from loadopt.device import finish_inputs
    from loadopt.imaging import decode
    from loadopt.imaging.decode import dct_denominator, decode_array
    from loadopt.imaging.frames import stored_frame
    from loadopt.imaging.geometry import whole_pixels
    from loadopt.imaging.reencode import with_restarts
    from loadopt.imaging.resize import crop_resize_flip_into
    from loadopt.loaders import crops, transforms
    from loadopt.storage.open import open_dataset

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/imagenet.yaml")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loader-batches", type=int, default=0, help="also time the torch tuned loader end to end")
    args = parser.parse_args()
    config = load_config(args.config)
    pipe, seed = config.pipeline, config.seed
    dataset = open_dataset(config)
    count = min(args.samples, len(dataset))
    blobs = [dataset.read(i) for i in range(count)]
    decoder = transforms.decoder_name("auto")
    if decode.jpeg_region is None:
        print("loadopt._jpeg is not built here (libjpeg-turbo headers missing at install): "
              "region decoding and reduced-scale decoding cannot be measured")
        return 1
    size, threads = pipe.image_size, args.threads
    # Every output page touched before any timed work: else the side timed first in round 1 paid the kernel's
    # page faults and zeroing of the whole batch (round 1 of lever_fused_resize at 0.48 here, 1.65-2.03 after).
    out = torch.zeros((count, 3, size, size), dtype=torch.uint8)  # zeroed: written
    out_nhwc = torch.zeros((count, size, size, 3), dtype=torch.uint8)
    out_hwc = out_nhwc.permute(0, 3, 1, 2)  # CHW views of the HWC slots
    pool = ThreadPoolExecutor(threads, initializer=one_thread_each)
    stored = [with_restarts(blob) for blob in blobs]  # the encoded forms' bytes

    def jpeg_work(region: bool, reduced: bool, fused: bool, hwc: bool = False, restarts: bool = False):
        samples, slots = (stored if restarts else blobs), (out_hwc if hwc else out)

        def work(positions: np.ndarray) -> None:
            for k in positions:
                pixels, box, flip = transforms.decode_planned(samples[k], decoder, pipe.augment, seed, 0, int(k),
                                                              region, size if reduced else None)
                crop_resize_flip_into(pixels, box, flip, slots[k], fused)
        return work

    def layout_work(hwc: bool):
        """The JPEG path into HWC (or CHW) slots, then each batch of a thread's positions finished from them as
        the emulated device does (`finish_inputs`, its buffers reused)."""
        decode_into = jpeg_work(True, False, True, hwc=hwc)

        def work(positions: np.ndarray) -> None:
            decode_into(positions)
            buffers: dict = {}

            def scratch(shape, dtype, purpose="out"):  # noqa: ANN001, ANN202 - finish_inputs' scratch hook
                key = (tuple(shape), dtype, purpose)
                if key not in buffers:
                    buffers[key] = torch.empty(shape, dtype=dtype)
                return buffers[key]

            for start in range(0, len(positions), pipe.batch_size):
                first, end = int(positions[start]), int(positions[min(start + pipe.batch_size, len(positions)) - 1]) + 1
                finish_inputs(out_nhwc[first:end] if hwc else out[first:end], "NHWC" if hwc else "NCHW", False, pipe,
                              scratch)
        return work

    frames = [stored_frame(blob, pipe.max_side) for blob in blobs]
    sources = [np.frombuffer(blob, np.uint8) for blob, _ in frames]
    dims = np.asarray([dim for _, dim in frames], np.int32)
    batch_out = np.full((count, size, size, 3), 0, np.uint8)  # touched, as `out`

    def frames_work(fused: bool):
        def work(positions: np.ndarray) -> None:
            crops.crop_frames(batch_out[positions[0]: positions[-1] + 1], positions,
                              [sources[k] for k in positions], np.arange(len(positions)),
                              np.zeros(len(positions), np.int64), dims[positions], pipe.augment, seed, 0,
                              _Inline, 1, fused)
        return work

    plans = []
    for k, blob in enumerate(blobs):
        pixels = decode_array(blob, decoder)
        box, flip = transforms.plan(pixels.shape[1], pixels.shape[0], pipe.augment, seed, 0, k)
        plans.append((pixels, whole_pixels(box)))

    def area_work(cv2_area: bool):
        import cv2

        hwc = np.empty((size, size, 3), np.uint8)
        slot = torch.empty((3, size, size), dtype=torch.uint8)

        def work(positions: np.ndarray) -> None:
            for k in positions:
                pixels, (left, top, right, bottom) = plans[k]
                if cv2_area:
                    cv2.resize(pixels[top:bottom, left:right], (size, size), dst=hwc, interpolation=cv2.INTER_AREA)
                else:
                    crop_resize_flip_into(pixels, (left, top, right, bottom), False, slot)
        return work

    levers = {
        "lever_region_decode": (jpeg_work(True, False, True), jpeg_work(False, False, True)),
        "lever_reduced_scale": (jpeg_work(True, True, True), jpeg_work(True, False, True)),
        "lever_fused_resize": (frames_work(True), frames_work(False)),
        "lever_hwc_slot": (layout_work(True), layout_work(False)),
        "lever_restart_markers": (jpeg_work(True, False, True, hwc=True, restarts=True),
                                  jpeg_work(True, False, True, hwc=True)),
        "lever_jpeg_path": (jpeg_work(True, False, True, hwc=True), jpeg_work(False, False, False)),
        "cv2_area_vs_torch_resize": (area_work(True), area_work(False)),
    }
    print(f"{args.config}: {count} samples in memory, mean {np.mean([len(b) for b in blobs]) / 1e3:.0f} KB, "
          f"mean {np.mean([p.shape[1] for p, _ in plans]):.0f} x {np.mean([p.shape[0] for p, _ in plans]):.0f} px; "
          f"{threads} threads, {args.rounds} rounds; stored frames <= {pipe.max_side} px; machine shared", flush=True)
    denoms = [dct_denominator(box, size) for _, box in plans]
    reduced_share = sum(d > 1 for d in denoms) / len(denoms)
    print("reduced scale applies to " + ", ".join(f"1/{d}: {denoms.count(d)}" for d in (1, 2, 4, 8)) + " samples")
    exact, reduced = torch.empty_like(out), torch.empty_like(out)
    jpeg_work(True, False, True)(np.arange(count))
    exact.copy_(out)
    jpeg_work(True, True, True)(np.arange(count))
    reduced.copy_(out)
    print(f"reduced scale: mean |difference| {(exact.float() - reduced.float()).abs().mean():.2f} levels, "
          f"max {(exact.int() - reduced.int()).abs().max()} (over every pixel of every sample)")
    for work in [w for pair in levers.values() for w in pair]:  # warm every in-process path once
        timed_rate(work, min(count, 2 * threads), pool, threads)
    region_module = decode.jpeg_region

    def loader_rate(region: bool, epoch: int) -> float:
        from _common import build_loader, harness_run

        decode.jpeg_region = region_module if region else None  # the forked workers inherit it
        try:
            loader = build_loader(config, "torch", variant="tuned", num_workers=2)
            metrics = harness_run(loader, args.loader_batches, warmup=3, epoch=epoch).metrics
            return metrics["samples_per_s"], 1000.0 / metrics["cpu_seconds_per_1k_samples"]
        finally:
            decode.jpeg_region = region_module

    if args.loader_batches:
        levers["lever_region_decode_loader"] = (lambda r: loader_rate(True, r), lambda r: loader_rate(False, r))
    # [with, without] x [images/s, images per CPU second], one entry a round
    rates: dict[str, list[list[list[float]]]] = {name: [[[], []], [[], []]] for name in levers}
    for r in range(args.rounds):
        for name, (with_lever, without) in levers.items():
            order = [(0, with_lever), (1, without)] if r % 2 == 0 else [(1, without), (0, with_lever)]
            for slot, work in order:
                wall, per_cpu = work(r) if name.endswith("_loader") else timed_rate(work, count, pool, threads)
                rates[name][slot][0].append(wall)
                rates[name][slot][1].append(per_cpu)
        print(f"round {r + 1} (img/s with/without): " + ", ".join(
            f"{n} {w[0][-1]:.0f}/{wo[0][-1]:.0f}" for n, (w, wo) in rates.items()), flush=True)
    lines = []
    for name, (with_lever, without) in rates.items():
        print(f"{name}: with {spread(with_lever[0], '.0f')} img/s, {spread(with_lever[1], '.0f')} img per CPU s; "
              f"without {spread(without[0], '.0f')} img/s, {spread(without[1], '.0f')} img per CPU s")
        cpu_ratios = [a / b for a, b in zip(with_lever[1], without[1], strict=True)]
        print(f"{name} per CPU second: per round " + ", ".join(f"{x:.3g}" for x in cpu_ratios)
              + f"; {spread(cpu_ratios)}")
        ratios = [a / b for a, b in zip(with_lever[0], without[0], strict=True)]
        if name == "lever_reduced_scale" and reduced_share < REDUCED_SHARE_HELD:
            # A lever held to a 10% gain only where it acts: on ImageNet-sized images almost no crop is
            # twice the output, so both sides run the same work and the ratio is noise around 1.
            print(f"{name}: applies to {reduced_share:.1%} of these samples (held only where >= "
                  f"{REDUCED_SHARE_HELD:.0%}: see configs/photos_large.yaml); per-round median "
                  f"{statistics.median(ratios):.3g}, printed, not held")
        elif name.startswith("lever_"):
            lines.append(ratio_result(name, ratios, ">=", TARGET))
        else:
            print(f"{name} (not applied: another kernel): per-round ratio median {statistics.median(ratios):.3g}")
    pool.shutdown()
    print("\n".join(lines))
    return 0


class _Inline:
    """A pool that runs the work in the calling thread (the bench's own threads split the samples)."""

    @staticmethod
    def map(fn, items):
        return [fn(item) for item in items]


if __name__ == "__main__":
    raise SystemExit(main())
