"""The tuner (`loadopt bench --tune`) against the full grid of every backend's knob space, in one run.

Both search the same space (each backend's `knob_space`, narrowed by the config's lists, without the
settings over this machine's cores and memory) and measure each setting with the same short run of
the harness (`--warmup` + `--measure` batches, samples/s over the last two thirds of the measured
batches: `tuner.steady_rate`); the grid runs every setting to the end, the tuner climbs from the
configured start and stops clearly worse settings early. Conversions are done before either clock.

Then the grid's best setting and the tuner's best setting are measured again, each in its own runs
(also when both picked the same setting), side by side, in `--rounds` interleaved rounds of a longer
run (`--confirm` batches), and compared round by round (held on the median):
- quality: tuner's best / grid's best samples/s, target >= 0.95;
- time: the tuner's search time / the grid's time, target <= 0.40.

    python benchmarks/tune_vs_grid.py [--config configs/imagenet.yaml] [--loaders torch,arrow,posix]
        [--warmup 3] [--measure 12] [--confirm 40] [--rounds 5]

Defaults take about 3 minutes on 2 cores once the dataset and its conversions are cached.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from _common import REPO, ratio_result, result_line


def grid_points(tuner, name: str) -> list:
    """Every setting of the backend's searched space that fits the machine (the same space the tuner searches)."""
    from loadopt.bench.knobs import search_space
    from loadopt.loaders.registry import backend_class

    cls = backend_class(name)
    space, start = search_space(tuner.config, name, cls, tuner.limits.cores)
    points = []
    for combo in itertools.product(*space.values()):
        point = cls.Settings(**{**start.model_dump(), **dict(zip(space, combo, strict=True))})
        if not tuner.limits.refuses(cls, point, tuner.config.pipeline):
            points.append(point)
    return points


def measure(tuner, name: str, settings, warmup: int, batches: int) -> float:
    from loadopt.bench.harness import run_repeat
    from loadopt.bench.tuner import steady_rate
    from loadopt.device import DeviceTransfer
    from loadopt.loaders.registry import backend_class

    loader = tuner._build(backend_class(name), settings)
    try:
        result = run_repeat(loader, tuner.accelerator, DeviceTransfer(tuner.device, emulate=True), warmup, batches)
    finally:
        loader.close()
    return steady_rate(result.probes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--loaders", default=None, help="comma-separated backends (default: the config's)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--measure", type=int, default=12)
    parser.add_argument("--confirm", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from loadopt.bench.tuner import Tuner, Window
    from loadopt.config import load_config
    from loadopt.device import resolve_device
    from loadopt.loaders.registry import backend_class
    from loadopt.storage.open import open_dataset

    config = load_config(args.config)
    dataset = open_dataset(config)
    names = args.loaders.split(",") if args.loaders else list(config.loaders)
    names = [n for n in names if backend_class(n).available()[0]]
    window = Window(warmup_batches=args.warmup, measure_batches=args.measure)
    tuner = Tuner(config, dataset, resolve_device(config.workload.device), budget_s=3600, window=window)
    print(f"{config.source}: backends {', '.join(names)}; {tuner.limits.cores} cores; each setting measured "
          f"{args.warmup} + {args.measure} batches", flush=True)

    # The tuner first: its setup prepares (converts) every value of every knob, outside both clocks.
    tunings = tuner.tune(names)
    tune_s = sum(t.seconds for t in tunings)

    grid: dict[str, list[tuple[float, object]]] = {}
    grid_start = time.perf_counter()
    for name in names:
        for point in grid_points(tuner, name):
            try:
                rate = measure(tuner, name, point, args.warmup, args.measure)
            except Exception as exc:  # noqa: BLE001 - a failing setting is one the grid cannot pick
                print(f"grid {name} {point.model_dump()}: failed: {exc}", flush=True)
                continue
            grid.setdefault(name, []).append((rate, point))
            print(f"grid {name} {point.model_dump()}: {rate:,.0f} samples/s", flush=True)
    grid_s = time.perf_counter() - grid_start

    print(f"\n{'backend':8s} {'grid size':>9s} {'grid best samples/s':>20s} {'tuner tried':>11s} "
          f"{'tuner best samples/s':>21s}  tuner's pick")
    for tuning in tunings:
        points = grid.get(tuning.backend, [])
        best_grid = max((r for r, _ in points), default=0.0)
        best = tuning.best.samples_per_s if tuning.best else 0.0
        label = tuning.best.label if tuning.best else tuning.reason
        print(f"{tuning.backend:8s} {len(points):9d} {best_grid:20,.0f} {len(tuning.trials):11d} "
              f"{best:21,.0f}  {label}")
    grid_pick = max(((r, n, p) for n, points in grid.items() for r, p in points), key=lambda x: x[0])
    tuned = [t for t in tunings if t.best is not None]
    tuner_pick = max(tuned, key=lambda t: t.best.samples_per_s)
    picks = {"grid": (grid_pick[1], grid_pick[2]), "tuner": (tuner_pick.backend, tuner_pick.best_settings)}
    same = picks["grid"][0] == picks["tuner"][0] and picks["grid"][1] == picks["tuner"][1]

    # Both picks measured again, each in its own runs (also when they are the same setting: the tuner's
    # figure is never the grid's copied), side by side, over interleaved rounds of a longer run, the
    # order alternating so that neither always runs second.
    confirmed: dict[str, list[float]] = {"grid": [], "tuner": []}
    for round_index in range(args.rounds):
        for who in ("grid", "tuner") if round_index % 2 == 0 else ("tuner", "grid"):
            confirmed[who].append(measure(tuner, *picks[who], args.warmup, args.confirm))
    grid_rate, tuner_rate = statistics.median(confirmed["grid"]), statistics.median(confirmed["tuner"])
    print(f"\ngrid's pick:  {picks['grid'][0]} {picks['grid'][1].model_dump()}: {grid_rate:,.0f} samples/s "
          f"(median of {args.rounds} runs of {args.confirm} batches)")
    print(f"tuner's pick: {picks['tuner'][0]} {picks['tuner'][1].model_dump()}: {tuner_rate:,.0f} samples/s"
          f"{' (the same setting, measured in its own runs)' if same else ''}")
    trials = sum(len(t.trials) for t in tunings)
    size = sum(len(p) for p in grid.values())
    print(f"time: tuner {tune_s:,.1f} s ({trials} settings tried, "
          f"{sum(1 for t in tunings for x in t.trials if x.outcome != 'ok')} stopped early or cut), "
          f"grid {grid_s:,.1f} s ({size} settings)")
    # Each round measured both picks back to back: each round's ratio, held on the median.
    print(ratio_result("tune_quality", [t / g for t, g in zip(confirmed["tuner"], confirmed["grid"], strict=True)],
                       ">=", 0.95))
    print("tune_time: one search each (a search is not repeated: the figure is a count of work, not a rate)")
    print(result_line("tune_time", tune_s / grid_s, "<=", 0.40))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
