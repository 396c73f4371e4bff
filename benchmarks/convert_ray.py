"""The same conversion written locally and on Ray (issue 35): `loadopt convert --engine local` against
`--engine ray` on the same 100k-file ImageFolder (benchmarks/scale.py's small JPEGs, ~2.6 KB a file, generated once
into `~/.cache/loadopt/scale`).

Each run is a fresh child process that opens the dataset (its listing cached), then times
`conversions.convert(..., force=True)` of the Arrow form (the JPEG bytes, `--to` to change) in `--shard-mib`
shards. Three configurations, interleaved over `--rounds` rounds:

- `local`: this machine's conversion, its decode pool of 2 processes (the machine's 2 cores);
- `ray2`, `ray1`: a Ray of 2 (1) CPUs started in the child before the clock starts, as a user of a running
  cluster meets it; Ray's start is timed apart and printed, and the files of every run are checked equal to
  the first local run's (the same checksums).

`RESULT ray_overhead ratio=<ray2 median ÷ local median> target<=1.15`,
`RESULT ray_scaling ratio=<ray1 median ÷ ray2 median> target>=1.7`, and the per-core constant (core-seconds
per 1M files: ray1's time x 10) that docs/scale.md extrapolates to 1B samples on N nodes.

    nice -n 10 python benchmarks/convert_ray.py [--files 100000] [--rounds 3] [--shard-mib 16] [--to arrow]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, result_line
from scale import SCALE_CACHE, dataset_root, label, write_config

_RUN = """
import hashlib, json, sys, time
from pathlib import Path
from loadopt.config import load_config
from loadopt.storage.forms import conversions
from loadopt.storage.forms.conversions import ConvertedForm
from loadopt.storage.forms.engine import ConvertEngine
from loadopt.storage.open import open_dataset
config, to, shard_mib, engine, cpus = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
dataset = open_dataset(load_config(config, []))
ray_start = 0.0
if engine == "ray":
    import ray
    began = time.perf_counter()
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - began
began = time.perf_counter()
done = conversions.convert(to, dataset, ConvertedForm("encoded", "centre", "encoded", None), shard_mib, force=True,
                           engine=ConvertEngine(engine))
seconds = time.perf_counter() - began
digest = hashlib.sha256()
for path in sorted(done.path.iterdir()):
    if path.name != "manifest.json":
        digest.update(path.name.encode() + hashlib.sha256(path.read_bytes()).digest())
print(json.dumps({"seconds": seconds, "ray_start": ray_start, "shards": done.shards, "samples": done.samples,
                  "digest": digest.hexdigest(), "manifest": json.loads((done.path / "manifest.json").read_text())
                  ["shard_table"]}))
"""

CONFIGS = {"local": ("local", 0), "ray2": ("ray", 2), "ray1": ("ray", 1)}


def run(config: Path, to: str, shard_mib: float, name: str) -> dict:
    engine, cpus = CONFIGS[name]
    env = {**os.environ, "LOADOPT_CACHE": str(SCALE_CACHE)}
    done = subprocess.run([sys.executable, "-c", _RUN, str(config), to, str(shard_mib), engine, str(cpus)],
                          capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-mib", type=float, default=16.0, help="the shards, so that 100k files make ~16")
    parser.add_argument("--to", default="arrow", choices=("arrow", "raw"))
    args = parser.parse_args()
    root = dataset_root(args.files, 64, 60)
    config = write_config(root, Path(tempfile.mkdtemp(prefix="convert-ray-")))
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    starts: list[float] = []
    reference: dict | None = None
    for round_ in range(args.rounds):
        order = list(CONFIGS) if round_ % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            result = run(config, args.to, args.shard_mib, name)
            times[name].append(result["seconds"])
            if result["ray_start"]:
                starts.append(result["ray_start"])
            reference = reference or result
            same = result["digest"] == reference["digest"] and result["manifest"] == reference["manifest"]
            started = f", Ray started in {result['ray_start']:.1f} s" if result["ray_start"] else ""
            print(f"round {round_ + 1} {name:>5}: {result['seconds']:7.2f} s, {result['shards']} shards{started}, "
                  f"files {'the same as' if same else 'DIFFERENT from'} the first run's", flush=True)
            if not same:
                raise SystemExit(f"{name}: the conversion differs from the first run's")
    print(f"\n{label(args.files)} files, --to {args.to}, --shard-mib {args.shard_mib:g}, {args.rounds} rounds")
    print(f"{'engine':>6} {'median s':>9} {'min':>7} {'max':>7} {'core-s per 1M files':>20}")
    cores = {"local": 2, "ray2": 2, "ray1": 1}
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        per_million = medians[name] * cores[name] * 1e6 / args.files
        print(f"{name:>6} {medians[name]:>9.2f} {min(values):>7.2f} {max(values):>7.2f} {per_million:>20.0f}")
    print(f"Ray's own start (not in the times above): median {statistics.median(starts):.1f} s")
    print(result_line("ray_overhead", medians["ray2"] / medians["local"], "<=", 1.15))
    print(result_line("ray_scaling", medians["ray1"] / medians["ray2"], ">=", 1.7))
    return 0


if __name__ == "__main__":
    sys.exit(main())
