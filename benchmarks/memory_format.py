"""What `pipeline.memory_format` costs: channels-last against contiguous batches, backend by backend.

Pre-decoded backends (arrow, posix) hold NHWC pixels: their float batches come out channels-last for
free (an NCHW view), and contiguous NCHW takes a transposing pass over the floats. torch (tuned) and
the JPEG paths decode to NCHW uint8: channels-last takes a uint8 transposition first. Each backend runs
through the harness (emulated device, step time 0, the config's pipeline) with each format,
interleaved in every round; the ratio held is channels-last's rate over contiguous's (the default
should cost no backend more than noise: target >= 0.95), and contiguous's cost is printed as a share
of the channels-last rate. Finishing alone (the per-batch work the format changes) is timed too.

    python benchmarks/memory_format.py [--config configs/imagenet.yaml] [--set KEY=VALUE ...]
                                  [--backends arrow,posix,torch] [--batches 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import REPO, build_loader, harness_run, ratio_result, spread

FORMATS = ("channels_last", "contiguous")


def finish_ms(pipeline, layout: str, rounds: int = 7) -> float:
    """Median ms to finish one batch of random pixels in `layout` (uint8) on the emulated device."""
    from loadopt.device import DeviceTransfer, finish_inputs

    size, b = pipeline.image_size, pipeline.batch_size
    pixels = torch.randint(0, 255, (b, size, size, 3) if layout == "NHWC" else (b, 3, size, size), dtype=torch.uint8)
    transfer = DeviceTransfer(torch.device("cpu"), emulate=True)
    times = []
    with transfer.device_work():
        for _ in range(rounds + 1):
            start = time.perf_counter()
            finish_inputs(pixels, layout, False, pipeline, transfer.scratch)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000  # the first allocates the scratch buffers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--backends", default="arrow,posix,torch")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from loadopt.config import load_config
    from loadopt.loaders.registry import backend_class

    settings = {"arrow": {"form": "decoded"}, "posix": {"form": "decoded"}, "torch": {"variant": "tuned"},
                "dali": {"normalise": "device", "layout": "NHWC"}}
    backends = [b for b in args.backends.split(",") if backend_class(b).available()[0]]
    configs = {fmt: load_config(args.config, [*args.overrides, f"pipeline.memory_format={fmt}"]) for fmt in FORMATS}
    pipeline = configs["channels_last"].pipeline
    print(f"batch {pipeline.batch_size} x {pipeline.image_size} px, {pipeline.dtype}, augment {pipeline.augment}; "
          f"{torch.get_num_threads()} torch threads; the machine is shared (others run beside this)")
    for layout in ("NHWC", "NCHW"):
        ms = {fmt: finish_ms(configs[fmt].pipeline, layout) for fmt in FORMATS}
        print(f"finish one batch from {layout} uint8: channels_last {ms['channels_last']:.1f} ms, "
              f"contiguous {ms['contiguous']:.1f} ms")
    for backend in backends:  # conversions first, outside the rounds
        build_loader(configs["channels_last"], backend, **settings.get(backend, {})).prepare()
    rates: dict[tuple[str, str], list[float]] = {(b, f): [] for b in backends for f in FORMATS}
    for round_index in range(args.rounds):
        line = []
        for backend in backends:
            for fmt in FORMATS if round_index % 2 == 0 else FORMATS[::-1]:
                loader = build_loader(configs[fmt], backend, **settings.get(backend, {}))
                rate = harness_run(loader, args.batches, warmup=3, epoch=round_index).metrics["samples_per_s"]
                rates[(backend, fmt)].append(rate)
                line.append(f"{backend} {fmt} {rate:,.0f}")
        print(f"round {round_index + 1}: " + ", ".join(line) + " images/s", flush=True)
    results = []
    for backend in backends:
        ratios = [a / b for a, b in zip(rates[(backend, "channels_last")], rates[(backend, "contiguous")],
                                        strict=True)]
        cost = [1 - 1 / r for r in ratios]
        print(f"{backend}: channels_last {spread(rates[(backend, 'channels_last')], ',.0f')} images/s; "
              f"contiguous {spread(rates[(backend, 'contiguous')], ',.0f')}; contiguous costs "
              f"{statistics.median(cost):.0%} of the channels-last rate (spread {min(cost):.0%} to {max(cost):.0%})")
        results.append(ratio_result(f"memory_format_{backend}_channels_last_over_contiguous", ratios, ">=", 0.95))
    for line in results:
        print(line)
    return 0 if backends else 1


if __name__ == "__main__":
    raise SystemExit(main())
