"""`torchrun -m loadopt bench` with 2 ranks on CPU (gloo): shards, one result, per-rank figures."""

import json
import os
import subprocess
import sys

import numpy as np
import yaml

from loadopt.bench.distributed import aggregate_ranks, indices_digest
from loadopt.loaders.sampler import EpochOrder

from .conftest import tiny_config_dict


def test_two_ranks_each_sample_once_per_epoch_one_result(tmp_path, cache_dir):
    out = tmp_path / "out"
    # 48 samples, batches of 8, 2 ranks: 3 batches a rank per epoch; 6 steps = 2 full epochs each
    config = tiny_config_dict(out, workload={"warmup_batches": 1, "measure_batches": 5, "repeats": 1},
                              loaders={"torch": {"variant": "tuned", "num_workers": 0}})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "LOADOPT_CACHE": str(cache_dir), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "loadopt",
                           "bench", str(path), "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("results: ") == 1  # rank 0 alone writes and prints
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".json") == ["results.json"]
    results = json.loads((out / "results.json").read_text())
    assert results["distributed"]["world_size"] == 2 and results["distributed"]["backend"] == "gloo"
    run = results["runs"][0]
    assert [r["rank"] for r in run["ranks"]] == [0, 1]
    shards = {}
    for rank_entry in run["ranks"]:
        rank = rank_entry["rank"]
        epochs = rank_entry["delivered"][0]
        assert [e["epoch"] for e in epochs] == [0, 1] and all(e["complete"] for e in epochs)
        for e in epochs:
            expected = EpochOrder(48, 8, 0, e["epoch"], rank, 2).indices()
            assert e["samples"] == 24 and e["digest"] == indices_digest(expected)
            shards.setdefault(e["epoch"], []).append(expected)
    for parts in shards.values():  # the ranks' shares are disjoint and cover every sample
        assert sorted(np.concatenate(parts).tolist()) == list(range(48))
    per_rank = [r["metrics"][0] for r in run["ranks"]]
    assert run["metrics"]["samples"]["median"] == sum(m["samples"] for m in per_rank) == 2 * 5 * 8
    assert run["slowest_rank"]["rank"] in (0, 1)
    assert "slowest rank" in results["summary"]


def test_aggregate_over_ranks():
    base = {"samples": 80, "batches": 10, "wall_s": 2.0, "compute_s": 1.0, "wait_s": 0.5, "h2d_s": 0.0,
            "finish_s": 0.0, "sample_bytes_delivered": 8e6, "bytes_read": 8e6, "storage_bytes_read": 0,
            "cpu_seconds": 1.0, "peak_rss_mb": 100.0, "peak_pss_mb": 50.0, "accelerator_utilisation": 0.5,
            "wait_p99_ms": 10.0, "samples_per_s": 40.0, "mb_per_s": 4.0, "stall_fraction": 0.5}
    other = {**base, "wall_s": 4.0, "accelerator_utilisation": 0.25, "wait_p99_ms": 30.0, "wait_s": 2.0}
    job = aggregate_ranks([base, other])
    assert job["samples"] == 160 and job["wall_s"] == 4.0 and job["samples_per_s"] == 40.0
    assert job["accelerator_utilisation"] == 0.375 and job["stall_fraction"] == 0.625
    assert job["wait_p99_ms"] == 30.0 and job["wait_s"] == 2.5 and job["mb_per_s"] == 4.0
    assert job["cpu_seconds_per_1k_samples"] == 2.0 / 160 * 1000
