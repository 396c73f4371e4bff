"""Harness overhead: the same loader iterated bare and through the harness (step time 0).

"Bare" does the same work as the harness (take each batch, move it to the emulated device) without
its probes, process-tree monitor and accelerator call. Rounds alternate so that drift on a shared
machine hits both alike; the ratio is median bare throughput over median harness throughput
(1.0 = no overhead); its spread is each round's bare / harness, and it is held on the median of those.

    python bench/harness_overhead.py [--config configs/imagenet.yaml] [--batches 60] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import REPO, build_loader, host_batches_forever, ratio_result


def bare(loader, batches: int) -> float:
    """Samples/s of the same work without the harness: each batch taken and moved to the (emulated)
    device exactly as the harness does, but no probes, no process monitor, no accelerator step."""
    from loadopt.device import DeviceTransfer

    transfer = DeviceTransfer(loader.device, emulate=True)
    iterator = host_batches_forever(loader)
    loader.finish(next(iterator), transfer)  # warm-up, as the harness's one warm-up batch
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        images, labels = loader.finish(next(iterator), transfer)
        samples += len(labels)
    rate = samples / (time.perf_counter() - start)
    iterator.close()
    return rate


def for_loop(loader, batches: int) -> float:
    """Samples/s of a user's `for images, labels in loader` (on the CPU: fresh output each batch)."""
    iterator = iter(loader)
    next(iterator)
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        try:
            images, labels = next(iterator)
        except StopIteration:
            iterator = iter(loader)
            images, labels = next(iterator)
        samples += len(labels)
    return samples / (time.perf_counter() - start)


def through_harness(loader, batches: int) -> float:
    from loadopt.bench.accelerator import EmulatedAccelerator
    from loadopt.bench.harness import run_repeat
    from loadopt.device import DeviceTransfer

    result = run_repeat(loader, EmulatedAccelerator(0.0, loader.device), DeviceTransfer(loader.device, emulate=True),
                        warmup_batches=1, measure_batches=batches)
    return result.metrics["samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    from loadopt.config import load_config

    config = load_config(args.config)
    settings = {"variant": "tuned", "num_workers": args.workers, "persistent_workers": True}
    rates: dict[str, list[float]] = {"bare": [], "harness": [], "for-loop": []}
    for round_index in range(args.rounds):
        for mode, measure in (("bare", bare), ("harness", through_harness), ("for-loop", for_loop)):
            loader = build_loader(config, "torch", **settings)
            loader.set_epoch(round_index)
            rates[mode].append(measure(loader, args.batches))
            loader.close()
            print(f"round {round_index + 1}: {mode:8s} {rates[mode][-1]:8.1f} samples/s", flush=True)
    print(f"\nloader: torch tuned num_workers={args.workers}, {args.batches} batches x {args.rounds} rounds each")
    print(f"{'mode':10s} {'median samples/s':>18s} {'min':>8s} {'max':>8s}")
    for mode, values in rates.items():
        print(f"{mode:10s} {statistics.median(values):18.1f} {min(values):8.1f} {max(values):8.1f}")
    print("(for-loop: a user's plain loop, for information: on a CPU-only machine it allocates a fresh output "
          "batch every step, which the harness's emulated device does not)")
    per_round = [b / h for b, h in zip(rates["bare"], rates["harness"], strict=True)]
    print(ratio_result("harness_overhead", per_round, "<=", 1.03))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
