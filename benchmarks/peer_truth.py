"""`benchmarks/peers.py --truth`: each peer backend in the harness against its library's own bare loop.

The cause of the gap this closed, and the figures measured, are in `benchmarks/peers.py`'s docstring.
"""

from __future__ import annotations

import os
import statistics

from _common import agreement, result_line, spread
from peers import WARMUP, WORKERS, Path, measure, prepare


def truth(config, chosen: list[Path], rounds: int, batches: int) -> int:
    """Each peer backend in the harness (step 0) against its own bare loop, interleaved (the order alternates
    per round); RESULT the agreement of the median harness / own-loop ratio, >= 0.9: within 10% either way."""
    peers = prepare(config, [p for p in chosen if p.peer])
    ratios: dict[str, list[float]] = {p.label: [] for p in peers}
    runs: dict[tuple[str, bool], list[tuple[float, float, float | None]]] = {}
    loads = [os.getloadavg()[0]]
    for round_index in range(rounds):
        for path in peers:
            bare_first = round_index % 2 == 0
            for bare in (bare_first, not bare_first):
                # the own loop keeps its library's loader across rounds, as side_by_side does (FFCV compiles its
                # pipeline once; its loaders made and dropped each round left threads that aborted the exit)
                runs.setdefault((path.label, bare), []).append(measure(config, path, batches, epoch=1, bare=bare,
                                                                       keep=True))
            ratios[path.label].append(runs[(path.label, False)][-1][0] / runs[(path.label, True)][-1][0])
        loads.append(os.getloadavg()[0])
        print(f"round {round_index + 1}/{rounds} done (load {loads[-1]:.1f})", flush=True)
    for path in peers:
        if path.own is not None:
            path.own.close()
    print(f"\nEach peer: {batches} batches of {config.pipeline.batch_size} after {WARMUP} warm-up batches, second "
          f"epoch, {WORKERS} workers or threads; load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} "
          "cores (medians; the spread is min-max over the rounds). CPU s/1k: the process tree's, per 1,000 samples "
          "(the same work on both sides reads the same, whatever the load); others: the machine's CPU that other "
          "processes used in the window, of all its cores (what a round's ratio swings with).")
    lines = []
    for path in peers:
        sides = {"harness": runs[(path.label, False)], "own loop": runs[(path.label, True)]}
        for side, measured in sides.items():
            others = [o for _, _, o in measured if o is not None]
            print(f"{path.label.replace(' (own loop)', '')} {side}: {spread([r for r, _, _ in measured], '.0f')} "
                  f"img/s; CPU s/1k {spread([c for _, c, _ in measured], '.2f')}; others "
                  + (f"{statistics.median(others):.0%}" if others else "not measured"))
        pairs = list(zip(sides["harness"], sides["own loop"], strict=True))
        cpu_ratio = [h[1] / o[1] for h, o in pairs]
        # each window's rate per CPU the machine left it (1 - others' share): both sides are loader-bound on
        # the cores others leave them (at nice 15 beneath their nice 0)
        adjusted = [h[0] / (1 - h[2]) / (o[0] / (1 - o[2])) for h, o in pairs
                    if h[2] is not None and o[2] is not None and max(h[2], o[2]) < 1]
        name = "peer_truth_" + path.backend + ("_" + path.settings["form"] if path.backend == "ffcv" else "")
        print(f"{name} harness / own loop: per round " + ", ".join(f"{r:.3g}" for r in ratios[path.label])
              + f"; {spread(ratios[path.label])}; CPU s/1k harness / own loop {spread(cpu_ratio)}")
        lines.append(result_line(name, agreement(statistics.median(ratios[path.label])), ">=", 0.9))
        if adjusted:
            print(f"{name}_per_available_cpu harness / own loop: per round " + ", ".join(f"{r:.3g}" for r in adjusted)
                  + f"; {spread(adjusted)}")
            lines.append(result_line(name + "_per_available_cpu", agreement(statistics.median(adjusted)), ">=", 0.9))
    for path in chosen:
        if path.peer and path.error:
            print(f"{path.label}: not measured: {path.error}")
    for line in lines:
        print(line)
    return 0 if lines else 1
