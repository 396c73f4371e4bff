"""Harness overhead: the same loader iterated bare and through the harness (step time 0).

"Bare" does the same work as the harness (take each batch, move it to the emulated device) without
its probes, process-tree monitor and accelerator call. Rounds alternate so that drift on a shared
machine hits both alike; the ratio is median bare throughput over median harness throughput
(1.0 = no overhead); its spread is each round's bare / harness, and it is held on the median of those.

Two loaders: torch tuned (a real pipeline: `harness_overhead`, target <= 1.03), and a loader that costs
nothing (`ReadyLoader`: every batch is one uint8 batch of the config's batch size made once in memory,
8 x 8 px so that finishing it costs microseconds). A loader-bound pipeline hides the harness's cost on
the consumer's side (the consumer waits for the loader anyway); with a loader that costs nothing the
consumer is the bottleneck, so each microsecond the harness adds per batch shows: its time per batch
minus the bare loop's, per round, against the config's step time (the time a training step leaves the
loader per batch): `harness_cost_of_step`, target <= 0.02 (the harness takes at most 2% of a step).
The time is the consumer process's CPU time (its threads: the harness's monitor too) per batch: on a
busy machine the wall time per batch of so little work is the scheduler's (seen: 5 ms a batch of wall
time for 0.65 ms of CPU, and the harness "faster" than the bare loop); the wall-clock figures are
printed beside it. `--zero-cost-batches` (default 300) sets its run length.

And the stall the harness reads where there is none: the zero-cost loader with prefetch (a thread keeps 4
batches ready, as a backend's workers do) against a 25 ms step can never keep the accelerator waiting, so
its stall is the harness's error (`harness_stall_zero_cost`, the median stall over the rounds, target
<= 0.01); the emulated device copies and finishes each batch beside the step before, as a GPU does.
`--stall-batches` (default 80) sets its run length.

    python benchmarks/harness_overhead.py [--config configs/imagenet.yaml] [--batches 60] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import REPO, build_loader, host_batches_forever, ratio_result, spread

STALL_STEP_S = 0.025
STALL_PREFETCH = 4


def ready_loader(config, prefetch: int = 0):
    """A loader that costs nothing: every batch is the same uint8 NCHW batch of the config's batch size (8 x 8
    px: finishing it costs microseconds), made once (a borrowed buffer, as a ring slot is), labels and
    indices from the shared sample order. `prefetch` > 0: a thread puts them in a queue of that depth (as a
    backend's workers keep batches ready)."""
    import queue
    import threading

    import torch

    from loadopt.loaders.base import HostBatch, Loader
    from loadopt.storage.open import open_dataset

    class ReadyLoader(Loader):
        name = "ready"

        def produce(self, batches):
            size = 8
            if not hasattr(self, "_ready"):
                generator = torch.Generator().manual_seed(0)
                self._ready = torch.randint(0, 256, (self.pipeline.batch_size, 3, size, size), dtype=torch.uint8,
                                            generator=generator)
            made = (HostBatch(self._ready[: len(indices)], torch.from_numpy(self.dataset.labels[indices]), indices,
                              "NCHW", normalised=False, borrowed=True) for indices in batches)
            if not prefetch:
                yield from made
                return
            ready: queue.Queue = queue.Queue(maxsize=prefetch)
            stop = threading.Event()

            def fill():
                for batch in [*made, None]:  # None: the end of the pass
                    while not stop.is_set():
                        try:
                            ready.put(batch, timeout=0.05)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return

            thread = threading.Thread(target=fill, daemon=True)
            thread.start()
            try:
                while (batch := ready.get()) is not None:
                    yield batch
            finally:
                stop.set()
                thread.join()

    return ReadyLoader(open_dataset(config), config.pipeline, seed=config.seed)


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


def through_harness(loader, batches: int, step_s: float = 0.0) -> dict:
    from loadopt.bench.accelerator import EmulatedAccelerator
    from loadopt.bench.harness import run_repeat
    from loadopt.device import DeviceTransfer

    result = run_repeat(loader, EmulatedAccelerator(step_s, loader.device),
                        DeviceTransfer(loader.device, emulate=True), warmup_batches=1, measure_batches=batches)
    return result.metrics


def harness_rate(loader, batches: int) -> float:
    return through_harness(loader, batches)["samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--zero-cost-batches", type=int, default=300)
    parser.add_argument("--stall-batches", type=int, default=80)
    args = parser.parse_args()

    from loadopt.config import load_config

    config = load_config(args.config)
    settings = {"variant": "tuned", "num_workers": args.workers, "persistent_workers": True}
    loaders = {"torch": lambda: build_loader(config, "torch", **settings), "zero-cost": lambda: ready_loader(config)}
    rates: dict[tuple[str, str], list[float]] = {}
    cpu_ms: dict[str, list[float]] = {"bare": [], "harness": []}  # the zero-cost loader's, per batch
    stalls: list[float] = []  # the prefetched zero-cost loader's at the 25 ms step
    split: list[tuple[float | None, float | None]] = []
    for round_index in range(args.rounds):
        loader = ready_loader(config, prefetch=STALL_PREFETCH)
        loader.set_epoch(round_index)
        metrics = through_harness(loader, args.stall_batches, STALL_STEP_S)
        loader.close()
        stalls.append(metrics["stall_fraction"])
        split.append((metrics.get("loader_stall_fraction"), metrics.get("finish_stall_fraction")))
        print(f"round {round_index + 1}: zero-cost prefetched, step {STALL_STEP_S * 1000:g} ms: stall "
              f"{stalls[-1]:.4f} (loader {split[-1][0]}, finish {split[-1][1]}), "
              f"{metrics['samples_per_s']:.1f} samples/s", flush=True)
        for name, make in loaders.items():
            modes = (("bare", bare), ("harness", harness_rate))
            if name == "torch":
                modes += (("for-loop", for_loop),)
            batches = args.batches if name == "torch" else args.zero_cost_batches
            for mode, measure in modes if round_index % 2 == 0 else reversed(modes):
                loader = make()
                loader.set_epoch(round_index)
                cpu = time.process_time()
                rates.setdefault((name, mode), []).append(measure(loader, batches))
                if name == "zero-cost":
                    cpu_ms[mode].append((time.process_time() - cpu) / (batches + 1) * 1000)  # + its warm-up batch
                loader.close()
                print(f"round {round_index + 1}: {name:9s} {mode:8s} {rates[(name, mode)][-1]:8.1f} samples/s",
                      flush=True)
    print(f"\nloaders: torch tuned num_workers={args.workers} ({args.batches} batches of "
          f"{config.pipeline.batch_size}), and one that costs nothing ({args.zero_cost_batches} batches); "
          f"{args.rounds} rounds each")
    print(f"{'loader':10s} {'mode':10s} {'median samples/s':>18s} {'min':>8s} {'max':>8s}")
    for (name, mode), values in rates.items():
        print(f"{name:10s} {mode:10s} {statistics.median(values):18.1f} {min(values):8.1f} {max(values):8.1f}")
    print("(for-loop: a user's plain loop, for information: on a CPU-only machine it allocates a fresh output "
          "batch every step, which the harness's emulated device does not)")
    batch, step_ms = config.pipeline.batch_size, config.workload.step_time_ms
    wall = [(batch / h - batch / b) * 1000 for b, h in zip(rates[("zero-cost", "bare")],
                                                            rates[("zero-cost", "harness")], strict=True)]
    added = [h - b for b, h in zip(cpu_ms["bare"], cpu_ms["harness"], strict=True)]
    print(f"zero-cost loader, CPU time per batch: bare loop {spread(cpu_ms['bare'], '.3f')} ms, through the harness "
          f"{spread(cpu_ms['harness'], '.3f')} ms; the harness's own {spread(added, '.3f')} ms a batch (wall clock: "
          f"{spread(wall, '.3f')} ms); the config's step {step_ms:g} ms")
    per_round = [b / h for b, h in zip(rates[("torch", "bare")], rates[("torch", "harness")], strict=True)]
    print(f"zero-cost loader with prefetch {STALL_PREFETCH}, {args.stall_batches} batches of {batch} against a "
          f"{STALL_STEP_S * 1000:g} ms step: truth {batch / STALL_STEP_S:,.0f} samples/s and no stall")
    lines = [ratio_result("harness_overhead", per_round, "<=", 1.03),
             ratio_result("harness_cost_of_step", [a / step_ms for a in added], "<=", 0.02),
             ratio_result("harness_stall_zero_cost", stalls, "<=", 0.01)]
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
