"""`tuned` against `plain` torch DataLoader, each at its best worker count, on the synthetic ImageNet.

Both variants run loader-bound (step time 0) through the harness; worker counts are swept and the
rounds interleaved so that drift hits all settings alike. Each variant's best worker count is the one
with the highest median; the ratio is the median over the rounds of tuned / plain at those counts
(both measured in the same round), its spread printed.
Each is also shown as a fraction of the decode ceiling measured in the same run (JPEG decode alone in
one worker process per core, one intra-op thread each, as the loaders' workers run).

    python benchmarks/torch_variants.py [--config configs/imagenet.yaml] [--workers 1,2,4] [--batches 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics

from _common import REPO, build_loader, harness_run, ratio_result, spread

from loadopt.machine import usable_cores


def loader_rate(config, variant: str, workers: int, batches: int, epoch: int) -> dict:
    loader = build_loader(config, "torch", variant=variant, num_workers=workers)
    return harness_run(loader, batches, epoch=epoch).metrics


def decode_ceiling(config, decoder: str, samples: int = 300) -> float:
    """Images/s the usable cores decode (decode alone, files already in memory), one worker process
    per core with one intra-op thread each (bench/attribution/parallel.py: the way the loaders' workers run)."""
    from loadopt.bench.attribution.parallel import rate_in_workers
    from loadopt.imaging.decode import decode_fast, decode_pil
    from loadopt.storage.open import open_dataset

    dataset = open_dataset(config)
    blobs = [dataset.read(i) for i in range(min(samples, len(dataset)))]
    decode = decode_fast if decoder == "simplejpeg" else decode_pil
    return rate_in_workers(lambda i: decode(blobs[i % len(blobs)]), usable_cores())["samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from loadopt.config import load_config
    from loadopt.loaders.transforms import decoder_name

    config = load_config(args.config)
    workers = [int(w) for w in args.workers.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    load = os.getloadavg()[0]
    for round_index in range(args.rounds):
        for variant in ("plain", "tuned"):
            for count in workers:
                metrics = loader_rate(config, variant, count, args.batches, epoch=round_index)
                rates.setdefault((variant, count), []).append(metrics["samples_per_s"])
                print(f"round {round_index + 1}: {variant} num_workers={count}: {metrics['samples_per_s']:7.1f} "
                      f"samples/s, CPU {metrics['cpu_seconds_per_1k_samples']:.2f} s/1k", flush=True)
    ceilings = {"pil": decode_ceiling(config, "pil"), "simplejpeg": decode_ceiling(config, decoder_name("auto"))}
    print(f"\ndecode ceiling (decode alone x {usable_cores()} cores): "
          f"PIL {ceilings['pil']:.0f} img/s, {decoder_name('auto')} {ceilings['simplejpeg']:.0f} img/s")
    print(f"{'variant':8s} {'workers':>7s} {'median samples/s':>17s} {'of decode ceiling':>18s}  spread samples/s")
    best: dict[str, tuple[int, float]] = {}
    for (variant, count), values in rates.items():
        rate = statistics.median(values)
        ceiling = ceilings["pil" if variant == "plain" else "simplejpeg"]
        print(f"{variant:8s} {count:7d} {rate:17.1f} {rate / ceiling:18.1%}  {spread(values, '.1f')}")
        if rate > best.get(variant, (0, 0.0))[1]:
            best[variant] = (count, rate)
    print(f"best: plain num_workers={best['plain'][0]} {best['plain'][1]:.1f}/s, "
          f"tuned num_workers={best['tuned'][0]} {best['tuned'][1]:.1f}/s")
    tuned, plain = rates[("tuned", best["tuned"][0])], rates[("plain", best["plain"][0])]
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({usable_cores()} cores; "
          "a shared machine)")
    # The best setting of each variant (by its median); each round's ratio of the two, held on the median.
    print(ratio_result("torch_tuned_vs_plain", [t / p for t, p in zip(tuned, plain, strict=True)], ">=", 1.8))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
