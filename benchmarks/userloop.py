"""The users' own tight loop: every loadopt path through `make_loader` beside each peer library in its own loop,
taking batches as fast as they come, on the same JPEGs, with each path's ceiling measured in the same run.

As a training script iterates (no harness, no emulated device, no step): `for inputs, labels in loader`, the
batches finished for the CPU device (normalised float32, channels-last NCHW) in the training process, second
epoch, `--batches` batches after `WARMUP`, 2 workers or threads each:
- peers: each library's own loop (`PeerLoader.bare_batches`: its format, reader, order and worker processes, the
  config's crop plan where it takes a transform, FFCV its own crops), each batch finished by the same code as
  loadopt's (`Loader.finish` on the CPU), so the peers pay no more for finishing than loadopt does; the torch
  DataLoader + PIL baseline is loadopt's `torch` backend, `variant: plain`, through `make_loader`;
- loadopt: `make_loader(config, backend=..., **settings)` on the CPU, conversions made before the rounds.
Rounds interleave every path (the order rotates each round). The ceilings, measured before the rounds and again
after (the higher kept): decode + crop of the source JPEGs (PIL for the plain DataLoader, the fastest decoder
for the others), of the encoded forms' stored JPEGs, DALI's CPU engine, crop + resize of stored whole frames,
each over the usable cores (`loadopt.bench.attribution.ceilings`), and the finishing of one batch on one thread.
A path's ceiling with its finishing included is `cores / (cores / ceiling + finishing seconds per sample)`:
what the machine's cores can deliver when they do both.

    python benchmarks/userloop.py [--config configs/peers.yaml] [--rounds 5] [--batches 50] [--only a,b]
                                  [--set KEY=VALUE ...]

RESULT lines: `userloop_jpeg_vs_best_peer` (best loadopt JPEG path / best peer JPEG path, per round, >= 2),
`userloop_predecoded_vs_best_peer` (best loadopt pre-decoded path / FFCV raw, >= 2; not measured without FFCV),
`userloop_<path>_of_ceiling` (each loadopt path's rate / its ceiling with finishing included, >= 0.85).
Figures measured: docs/performance/userloop.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _common import REPO, build_loader, ratio_result, result_line, spread

WARMUP = 3
WORKERS = 2


@dataclass
class UserPath:
    label: str
    backend: str
    kind: str  # jpeg | predecoded
    peer: bool
    settings: dict[str, Any] = field(default_factory=dict)
    rates: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    consumer: list[float] = field(default_factory=list)  # the training process's own CPU, us per sample
    loader: Any = None  # kept across rounds, as a training script keeps one loader over its epochs
    error: str | None = None
    ceiling: str = ""  # the key of the ceiling that bounds it (see `ceiling_of`)

    @property
    def name(self) -> str:
        return self.label.removeprefix("loadopt ").replace(" ", "_")


def paths() -> list[UserPath]:
    jpeg, pre = "jpeg", "predecoded"
    return [
        UserPath("torch DataLoader + PIL", "torch", jpeg, True, {"variant": "plain", "num_workers": WORKERS},
                 ceiling="pil"),
        UserPath("webdataset", "webdataset", jpeg, True, {"num_workers": WORKERS}, ceiling="fast"),
        UserPath("litdata", "litdata", jpeg, True, {"num_workers": WORKERS}, ceiling="fast"),
        UserPath("streaming", "streaming", jpeg, True, {"num_workers": WORKERS}, ceiling="fast"),
        UserPath("ffcv jpg", "ffcv", jpeg, True, {"num_workers": WORKERS, "form": "jpg"}, ceiling="fast"),
        UserPath("ffcv raw", "ffcv", pre, True, {"num_workers": WORKERS, "form": "raw"}, ceiling="crop"),
        UserPath("loadopt torch tuned", "torch", jpeg, False, {"variant": "tuned", "num_workers": WORKERS},
                 ceiling="fast"),
        UserPath("loadopt dali cpu", "dali", jpeg, False, {"num_threads": WORKERS, "normalise": "device",
                                                            "layout": "NHWC"}, ceiling="dali"),
        UserPath("loadopt arrow encoded", "arrow", jpeg, False, {"form": "encoded", "threads": WORKERS},
                 ceiling="stored"),
        UserPath("loadopt posix encoded", "posix", jpeg, False, {"form": "encoded", "threads": WORKERS},
                 ceiling="stored"),
        UserPath("loadopt arrow decoded", "arrow", pre, False, {"form": "decoded", "threads": WORKERS},
                 ceiling="crop"),
        UserPath("loadopt posix decoded", "posix", pre, False, {"form": "decoded", "threads": WORKERS},
                 ceiling="crop"),
    ]


def through_make_loader(path: UserPath) -> bool:
    return path.backend in ("torch", "dali", "arrow", "posix")


def open_path(config, path: UserPath) -> None:
    """Build the path's loader once (conversions made here, outside every window); a path that cannot run says why."""
    from loadopt.api import make_loader
    from loadopt.loaders.registry import backend_class

    ok, reason = backend_class(path.backend).available()
    if not ok:
        path.error = reason
        return
    try:
        if through_make_loader(path):
            path.loader = make_loader(config, backend=path.backend, device="cpu", epoch=1, **path.settings)
        else:
            path.loader = build_loader(config, path.backend, **path.settings)
            path.loader.prepare()
    except Exception as exc:  # noqa: BLE001 - a path that cannot run is a row that says why
        path.error = f"{type(exc).__name__}: {exc}".splitlines()[0]


def user_batches(path: UserPath):
    """The batches as the user's loop gets them, finished for the CPU, from the second epoch's first batch."""
    from loadopt.loaders.base import HostBatch

    loader = path.loader
    if through_make_loader(path):
        loader.set_epoch(1)
        for batch in loader:
            yield batch[0]
        return
    no_indices = np.empty(0, np.int64)
    epoch = 1
    while True:  # a short epoch: carry on into the next, as a training script does
        stream = loader.bare_batches(epoch)
        try:
            for inputs, labels, layout in stream:
                yield loader.finish(HostBatch(inputs, labels, no_indices, layout, normalised=False))[0]
        finally:
            stream.close()
        epoch += 1


def tight_loop(path: UserPath, batches: int) -> tuple[float, float, float]:
    """(samples/s, CPU s per 1,000 samples of the process tree, the training process's own CPU us per sample: its
    threads, the finishing among them) over `batches` batches after `WARMUP`."""
    import resource

    from loadopt.bench.monitor import ProcessTreeMonitor

    monitor = ProcessTreeMonitor()
    stream = user_batches(path)
    samples, start, own = 0, 0.0, 0.0
    try:
        for n, inputs in enumerate(stream):
            if n == WARMUP - 1:  # the window opens when batch WARMUP is asked for
                monitor.start()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                own = usage.ru_utime + usage.ru_stime
                start = time.perf_counter()
            elif n >= WARMUP:
                samples += len(inputs)
                if n == WARMUP + batches - 1:
                    break
        wall = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
        own = usage.ru_utime + usage.ru_stime - own
    finally:
        stream.close()
        if monitor.running:
            monitor.stop()
    tree = monitor.usage
    return (samples / wall, tree.cpu_seconds / samples * 1000 if tree and samples else float("nan"),
            own / samples * 1e6 if samples else float("nan"))


def finishing_seconds_per_sample(config, repeats: int = 30) -> float:
    """One thread's cost of finishing one sample for the CPU (uint8 NHWC -> normalised float32), as
    `Loader.finish` does it: the median of `repeats` batches into recycled memory."""
    import torch

    from loadopt.device import finish_inputs

    try:
        from loadopt.loaders.recycled_memory import RecycledBuffers

        memory = RecycledBuffers()
        scratch = lambda shape, dtype, purpose="out": memory.empty(shape, dtype)  # noqa: E731
    except ImportError:  # a tree from before recycled memory: fresh memory per batch, as its `Loader.finish` took
        scratch = None
    p = config.pipeline
    batch = torch.randint(0, 256, (p.batch_size, p.image_size, p.image_size, 3), dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        finish_inputs(batch, "NHWC", False, p, scratch)
        times.append(time.perf_counter() - begin)
    return statistics.median(times) / p.batch_size


def ceilings(config) -> dict[str, float]:
    """samples/s over the usable cores of each stage a path can be bound by (`UserPath.ceiling`), and the finishing."""
    from loadopt.bench.attribution.ceilings import crop_resize_rate, decode_rates
    from loadopt.storage.open import open_dataset

    dataset = open_dataset(config)
    decode = decode_rates(config, dataset)
    out = {key: decode.rate(key).samples_per_s or 0.0 for key in ("pil", "fast", "stored", "dali")}
    out["crop"] = crop_resize_rate(config, dataset).samples_per_s or 0.0
    out["finish_s"] = finishing_seconds_per_sample(config)
    return out


def with_finishing(rate: float, finish_s: float, cores: int) -> float:
    """The cores' rate doing both a stage measured at `rate` over them and the finishing (one core's seconds)."""
    return cores / (cores / rate + finish_s) if rate else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "peers.yaml"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated backends to run (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args()
    os.environ.setdefault("LOADOPT_QUIET", "1")

    from loadopt.config import load_config
    from loadopt.machine import usable_cores

    config = load_config(args.config, args.set)
    cores = usable_cores()
    only = {name for name in args.only.split(",") if name}
    chosen = [p for p in paths() if not only or p.backend in only]
    print(f"config {args.config}: batch {config.pipeline.batch_size}, image {config.pipeline.image_size}, "
          f"{cores} usable cores, load {os.getloadavg()[0]:.1f}", flush=True)
    for path in chosen:
        open_path(config, path)
    usable = [p for p in chosen if p.error is None]
    measured = [ceilings(config)]
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        for path in usable[round_index % len(usable):] + usable[: round_index % len(usable)]:
            try:
                rate, cpu, consumer = tight_loop(path, args.batches)
            except Exception as exc:  # noqa: BLE001 - a path that failed is a row that says why
                path.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                continue
            path.rates.append(rate)
            path.cpu.append(cpu)
            path.consumer.append(consumer)
        loads.append(os.getloadavg()[0])
        print(f"round {round_index + 1}/{args.rounds} done (load {loads[-1]:.1f})", flush=True)
    measured.append(ceilings(config))
    for path in usable:
        path.loader.close()
    best = {key: max(m[key] for m in measured) for key in measured[0] if key != "finish_s"}
    finish_s = min(m["finish_s"] for m in measured)
    print(f"\nCeilings over {cores} cores (samples/s, the higher of before and after the rounds): "
          + ", ".join(f"{k} {v:,.0f}" for k, v in best.items())
          + f"; finishing {finish_s * 1e6:.0f} us a sample on one thread")
    print(f"\n{'path':26} {'kind':10} {'samples/s (median, spread)':30} {'CPU s/1k':>8} {'loop us':>7} "
          f"{'ceiling+fin':>11} {'of it':>6}")
    lines: list[str] = []
    for path in chosen:
        if path.error or not path.rates:
            print(f"{path.label:26} {path.kind:10} not run: {path.error or 'no rounds'}")
            continue
        bound = with_finishing(best[path.ceiling], finish_s, cores)
        rate = statistics.median(path.rates)
        share = rate / bound if bound else float("nan")
        print(f"{path.label:26} {path.kind:10} {rate:8,.0f} ({min(path.rates):,.0f}-{max(path.rates):,.0f}){'':8}"
              f" {statistics.median(path.cpu):8.2f} {statistics.median(path.consumer):7.0f} {bound:11,.0f}"
              f" {share:6.2f}")
    print(f"\n{args.batches} batches of {config.pipeline.batch_size} after {WARMUP} warm-up batches, second epoch, "
          f"{WORKERS} workers or threads, {args.rounds} interleaved rounds; load average {min(loads):.1f}-"
          f"{max(loads):.1f}; ceiling+fin: the path's bounding ceiling "
          f"({', '.join(sorted({p.ceiling for p in usable}))}) with the finishing included; CPU s/1k: the process "
          "tree's per 1,000 samples; loop us: the training process's own CPU per sample (its threads: the finishing, "
          "the backend's consumer side).")
    for kind, name, peers_allowed in (("jpeg", "userloop_jpeg_vs_best_peer", None),
                                      ("predecoded", "userloop_predecoded_vs_best_peer", {"ffcv raw"})):
        ours = [p for p in usable if p.kind == kind and not p.peer and p.rates]
        peers = [p for p in usable if p.kind == kind and p.peer and p.rates
                 and (peers_allowed is None or p.label in peers_allowed)]
        if not ours or not peers:
            missing = [p.label + ": " + (p.error or "no rounds") for p in chosen if p.kind == kind and p.peer
                       and not p.rates]
            print(f"{name}: not measured: no peer path of this kind ran here ({'; '.join(missing)})")
            continue
        mine = max(ours, key=lambda p: statistics.median(p.rates))
        theirs = max(peers, key=lambda p: statistics.median(p.rates))
        rounds = min(len(mine.rates), len(theirs.rates))
        print(f"{name}: {mine.label} / {theirs.label}")
        lines.append(ratio_result(name, [a / b for a, b in zip(mine.rates[:rounds], theirs.rates[:rounds],
                                                                strict=True)], ">=", 2))
    for path in usable:
        if not path.peer and path.rates:
            bound = with_finishing(best[path.ceiling], finish_s, cores)
            ratios = [r / bound for r in path.rates] if bound else [float("nan")]
            print(f"userloop_{path.name}_of_ceiling: {spread(ratios)}")
            lines.append(result_line(f"userloop_{path.name}_of_ceiling", statistics.median(ratios), ">=", 0.85))
    for line in lines:
        print(line)
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
