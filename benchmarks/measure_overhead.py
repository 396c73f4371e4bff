"""Overhead of `loadopt.measure`: a loop over zero-cost batches, bare and wrapped, side by side.

The batches are already in a list (a batch costs nothing to produce) and the loop body does
nothing, so everything the wrapper adds per step shows. Rounds alternate bare / wrapped / marks so
drift on a shared machine hits all alike; the figure is the median added microseconds per step
(wrapped minus bare). Logging is off: the verdict is not part of the per-step cost.

    python benchmarks/measure_overhead.py [--steps 200000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from _common import ratio_result


def bare(batches: list) -> float:
    start = time.perf_counter()
    for _batch in batches:
        pass
    return time.perf_counter() - start


def wrapped(batches: list) -> float:
    import loadopt

    measured = loadopt.measure(batches, device="cpu")
    start = time.perf_counter()
    for _batch in measured:
        pass
    return time.perf_counter() - start


def marks(batches: list) -> float:
    """The `measure_steps` form: a batch() and a step() mark per step."""
    import loadopt

    start = time.perf_counter()
    with loadopt.measure_steps(device="cpu") as m:
        for batch in batches:
            m.batch(batch)
            m.step()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch

    logging.getLogger("loadopt.measure").setLevel(logging.WARNING)
    batch = (torch.zeros(32, 3, 8, 8), torch.zeros(32, dtype=torch.long))  # samples counted from the tensor
    batches = [batch] * args.steps
    times: dict[str, list[float]] = {"bare": [], "measure()": [], "measure_steps": []}
    for round_index in range(args.rounds):
        for mode, run in (("bare", bare), ("measure()", wrapped), ("measure_steps", marks)):
            times[mode].append(run(batches))
        print(f"round {round_index + 1}: " + ", ".join(f"{mode} {values[-1] / args.steps * 1e6:.3f} us/step"
                                                       for mode, values in times.items()), flush=True)
    bare_us = statistics.median(times["bare"]) / args.steps * 1e6
    print(f"\n{args.steps:,} zero-cost batches x {args.rounds} rounds")
    print(f"{'mode':15s} {'us/step (median)':>17s} {'min':>8s} {'max':>8s} {'added us/step':>14s}")
    added = {}
    for mode, values in times.items():
        per_step = [v / args.steps * 1e6 for v in values]
        added[mode] = statistics.median(per_step) - bare_us
        print(f"{mode:15s} {statistics.median(per_step):17.3f} {min(per_step):8.3f} {max(per_step):8.3f} "
              f"{added[mode]:14.3f}")
    # Each round's added microseconds per step (wrapped minus bare of the same round), held on the median.
    per_round = [(w - b) / args.steps * 1e6 for w, b in zip(times["measure()"], times["bare"], strict=True)]
    print(ratio_result("measure_overhead", per_round, "<", 20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
