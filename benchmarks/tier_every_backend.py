"""Every backend under a 20 MB/s emulated tier, cold: does the tier cap it, and do its counters see
every byte it reads (no backend bypasses the tier by memory-mapping or preading its converted files)?

Settings: torch plain and tuned, dali, arrow decoded and encoded, posix decoded and encoded (kvikio
decoded and encoded where it runs), each loader-bound (step time 0) on a small synthetic ImageNet-
shaped dataset, through a fresh instance of the tier per run, its files evicted from the page cache
first. Warm-up and measured window are one whole epoch each, so that neither count includes reads
ahead of the window's edges. Rounds interleave the settings. Per setting, on the median over rounds:

- `tier_caps_<setting>`: the stored form's bytes the backend read per second (its `bytes_read`: JPEGs,
  Arrow rows or raw shard runs) / 20 MB/s; target <= 1.1 (a backend that bypassed the tier runs far
  past it);
- `tier_bytes_<setting>`: bytes that crossed the tier / `bytes_read`; target >= 0.95.

    python benchmarks/tier_every_backend.py [--rounds 5] [--samples 160] [--batch 32] [--mb-s 20]
"""

from __future__ import annotations

import argparse
import os
import statistics

from _common import REPO, ratio_result, spread

SETTINGS = [("torch_plain", "torch", {"variant": "plain", "num_workers": 2}),
            ("torch_tuned", "torch", {"variant": "tuned", "num_workers": 2}),
            ("dali", "dali", {"num_threads": 2}),
            ("arrow_decoded", "arrow", {"form": "decoded"}), ("arrow_encoded", "arrow", {"form": "encoded"}),
            ("posix_decoded", "posix", {"form": "decoded"}), ("posix_encoded", "posix", {"form": "encoded"}),
            ("kvikio_decoded", "kvikio", {"form": "decoded"}), ("kvikio_encoded", "kvikio", {"form": "encoded"})]


def one_run(config, backend: str, settings: dict) -> dict:
    """Prepare (convert, not timed), evict the files it reads, then one epoch of warm-up and one measured."""
    from loadopt.bench.accelerator import EmulatedAccelerator
    from loadopt.bench.harness import run_repeat
    from loadopt.config import expand_settings
    from loadopt.device import DeviceTransfer, resolve_device
    from loadopt.loaders.registry import backend_class
    from loadopt.storage.open import open_dataset
    from loadopt.storage.tiers.pagecache import evict

    cls = backend_class(backend)
    dataset = open_dataset(config)  # a fresh instance of the tier: its own clock and counters
    point = expand_settings(cls.Settings, settings, f"loaders.{backend}", "bench")[0]
    device = resolve_device(config.workload.device)
    loader = cls(dataset, config.pipeline, point, device=device, seed=config.seed)
    try:
        loader.prepare()
        evict(loader.storage_files())
        epoch = len(loader)
        result = run_repeat(loader, EmulatedAccelerator(0.0, device), DeviceTransfer(device, emulate=True),
                            warmup_batches=epoch, measure_batches=epoch)
    finally:
        loader.close()
    return {**result.metrics, "label": loader.describe()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mb-s", type=float, default=20.0)
    args = parser.parse_args()

    from loadopt.config import load_config
    from loadopt.loaders.registry import backend_class

    config = load_config(args.config, [
        f"dataset.synthetic.num_samples={args.samples}", f"pipeline.batch_size={args.batch}",
        f"storage.tier={{name: tier_{args.mb_s:g}mb, bandwidth_mb_s: {args.mb_s}}}", "storage.cache=cold"])
    runnable = []
    for name, backend, settings in SETTINGS:
        available, reason = backend_class(backend).available()
        if available:
            runnable.append((name, backend, settings))
        else:
            print(f"{name}: not run here: {reason}")
    load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in runnable}
    failed: dict[str, str] = {}
    for round_index in range(args.rounds):
        for name, backend, settings in runnable:
            if name in failed:
                continue
            try:
                metrics = one_run(config, backend, settings)
            except Exception as exc:  # noqa: BLE001 - reported; the other settings go on
                failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                print(f"round {round_index + 1}: {name}: FAILED: {failed[name]}", flush=True)
                continue
            runs[name].append(metrics)
            print(f"round {round_index + 1}: {name:15s} {metrics['bytes_read'] / metrics['wall_s'] / 1e6:6.2f} MB/s "
                  f"read, tier_bytes/bytes_read {(metrics['tier_bytes'] or 0) / max(1, metrics['bytes_read']):.3f}, "
                  f"{metrics['samples_per_s']:6.1f} samples/s  ({metrics['label']})", flush=True)
    print(f"\ntier: {args.mb_s:g} MB/s emulated over the local disk, cold; {args.samples} samples, batch {args.batch}, "
          "step time 0; one epoch of warm-up, one measured")
    header = ("setting", "read MB/s", "JPEG MB/s", "samples/s", "tier/read")
    print(f"{header[0]:15s} " + " ".join(f"{h:>9s}" for h in header[1:]) + "  spread of read MB/s")
    lines = []
    for name, _, _ in runnable:
        rounds = runs[name]
        if not rounds:
            continue
        read = [m["bytes_read"] / m["wall_s"] / 1e6 for m in rounds]
        crossed = [(m["tier_bytes"] or 0) / m["bytes_read"] for m in rounds]
        print(f"{name:15s} {statistics.median(read):9.2f} {statistics.median(m['mb_per_s'] for m in rounds):9.2f} "
              f"{statistics.median(m['samples_per_s'] for m in rounds):9.1f} {statistics.median(crossed):9.3f}  "
              f"{spread(read, '.2f')}")
        lines.append(ratio_result(f"tier_caps_{name}", [r / args.mb_s for r in read], "<=", 1.1))
        lines.append(ratio_result(f"tier_bytes_{name}", crossed, ">=", 0.95))
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (a shared machine)")
    for name, reason in failed.items():
        print(f"{name}: could not be measured: {reason}")
    for line in lines:
        print(line)
    return 1 if failed or not lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
