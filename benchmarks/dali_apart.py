"""What DALI's child process costs its figures: `loadopt bench` runs each DALI setting in a forked child (a crash
of its decoder on bad bytes is then that setting's failure, not the bench's end); the same setting run in the
bench's own process (its samples screened first instead) is the reference. Both through `loadopt bench` on the
same ImageFolder, rounds interleaved, each round's child rate ÷ its in-process rate:

    RESULT dali_child_vs_in_process ratio=<samples/s in the child / in process> target>=0.9

    python benchmarks/dali_apart.py [--images 300] [--rounds 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import yaml
from _common import ratio_result
from PIL import Image
from typer.testing import CliRunner

from loadopt.bench import runner
from loadopt.cli import app


def photos(root: Path, count: int) -> Path:
    """`count` JPEGs of 140-320 px sides in 10 class folders (gradients: cheap to make, real to decode)."""
    rng = np.random.default_rng(0)
    for k in range(count):
        folder = root / "train" / f"n{k % 10:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        width, height = int(rng.integers(160, 320)), int(rng.integers(140, 300))
        pixels = np.broadcast_to(np.linspace(0, 255, width, dtype=np.uint8)[None, :, None], (height, width, 3)).copy()
        pixels[..., 1] = (k * 7) % 255
        Image.fromarray(pixels).save(folder / f"img{k:04d}.jpg", quality=88)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="loadopt-dali-apart-"))
    config = work / "dali.yaml"
    config.write_text(yaml.safe_dump({
        "name": "dali-apart", "seed": 0, "dataset": {"path": str(photos(work / "photos", args.images))},
        "pipeline": {"batch_size": 32, "image_size": 128, "augment": "train"},
        "workload": {"step_time_ms": 5, "warmup_batches": 2, "measure_batches": 30, "repeats": args.repeats},
        "loaders": {"dali": {"num_threads": 2}}, "report": {"out": str(work / "results")}}))
    apart = runner.can_run_apart
    ratios = []
    for round_ in range(args.rounds):
        rates = {}
        for where in ("child", "in process") if round_ % 2 == 0 else ("in process", "child"):
            runner.can_run_apart = apart if where == "child" else (lambda device, world_size: False)
            result = CliRunner().invoke(app, ["bench", str(config)])
            if result.exit_code != 0:
                raise SystemExit(result.output)
            runs = json.loads((work / "results" / "results.json").read_text())["runs"]
            rates[where] = statistics.median(r["samples_per_s"] for run in runs for r in run["repeats"])
        print(f"round {round_ + 1}: child {rates['child']:,.0f} samples/s, in process {rates['in process']:,.0f}",
              flush=True)
        ratios.append(rates["child"] / rates["in process"])
    runner.can_run_apart = apart
    print(ratio_result("dali_child_vs_in_process", ratios, ">=", 0.9))


if __name__ == "__main__":
    main()
