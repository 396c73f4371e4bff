"""`torchrun -m loadopt bench` with 2 ranks on CPU (gloo): shards, one result, per-rank figures; every option
of a bench (--tune, the attribution, the decision) and a setting that fails on one rank failing alone."""

import json
import os
import subprocess
import sys

import numpy as np
import yaml

from loadopt.bench.rank_figures import aggregate_ranks, indices_digest
from loadopt.loaders.sampler import EpochOrder

from .conftest import REPO, tiny_config_dict


def torchrun(tmp_path, cache_dir, config: dict, *args: str, program: tuple[str, ...] = ("-m", "loadopt")):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "LOADOPT_CACHE": str(cache_dir), "COLUMNS": "200", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *program,
                           "bench", str(path), *args], capture_output=True, text=True, env=env, timeout=600)


def test_two_ranks_each_sample_once_per_epoch_one_result(tmp_path, cache_dir):
    out = tmp_path / "out"
    # 48 samples, batches of 8, 2 ranks: 3 batches a rank per epoch; 6 steps = 2 full epochs each
    config = tiny_config_dict(out, workload={"warmup_batches": 1, "measure_batches": 5, "repeats": 1},
                              loaders={"torch": {"variant": "tuned", "num_workers": 0}})
    proc = torchrun(tmp_path, cache_dir, config, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("results: ") == 1  # rank 0 alone writes and prints
    # one results file, and the decision beside it (as in one process)
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".json") == ["decision.json", "results.json"]
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


def test_tune_attribution_and_decision_under_torchrun(tmp_path, cache_dir):
    out = tmp_path / "out"
    config = tiny_config_dict(out, workload={"warmup_batches": 1, "measure_batches": 5, "repeats": 1},
                              loaders={"torch": {"variant": "tuned", "num_workers": [0, 1]}})
    proc = torchrun(tmp_path, cache_dir, config, "--out", str(out), "--tune", "--budget", "1m")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("results: ") == 1
    results = json.loads((out / "results.json").read_text())
    decision = json.loads((out / "decision.json").read_text())
    assert results["distributed"]["world_size"] == 2
    best = results["runs"][0]
    assert best["status"] == "ok" and [r["rank"] for r in best["ranks"]] == [0, 1]
    assert decision["label"] == results["ranking"][0] == best["label"]
    assert results["tuning"]["backends"][0]["tried"] >= 1 and best["tuned"]["tried"] >= 1
    # the attribution: the ceilings (the job's demand is both ranks' accelerators), a verdict, the stages apart
    job = results["ceilings"]["job"]
    assert job["ranks"] == 2 and job["demand_samples_per_s"] == 2 * 8 / (job["step_ms"] / 1000.0)
    assert best["ceiling"]["samples_per_s"] and [v["label"] for v in results["verdicts"]] == [best["label"]]
    assert [s["label"] for s in results["stages"]] == [best["label"]]
    assert results["verdicts"][0]["by"] == "stages measured apart"


FAILING_BACKENDS = """
from loadopt.cli import main
from loadopt.loaders.registry import register
from tests.backends import DelayLoader


@register("t_fails_mid_run")
class FailsMidRunOnRank1(DelayLoader):
    def produce(self, batches):
        for n, batch in enumerate(super().produce(batches)):
            if self.rank == 1 and n == 2:  # rank 0 waits in the step's all-reduce meanwhile
                raise RuntimeError("rank 1's device fell over")
            yield batch


@register("t_fails_to_open")
class FailsToOpenOnRank1(DelayLoader):
    def prepare(self, progress=None, convert_missing=True):
        if self.rank == 1:
            raise RuntimeError("rank 1 cannot open its shard")
        super().prepare(progress, convert_missing)


main()
"""


def test_a_backend_failing_on_one_rank_fails_alone(tmp_path, cache_dir):
    out = tmp_path / "out"
    script = tmp_path / "bench_with_failing_backends.py"
    script.write_text(FAILING_BACKENDS)
    config = tiny_config_dict(out, workload={"warmup_batches": 1, "measure_batches": 5, "repeats": 2},
                              loaders={"t_fails_mid_run": {"delay_s": 0.001, "background": False},
                                       "torch": {"variant": "tuned", "num_workers": 0},
                                       "t_fails_to_open": {"delay_s": 0.001, "background": False}})
    proc = torchrun(tmp_path, cache_dir, config, "--out", str(out), program=(str(script),))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    runs = {r["backend"]: r for r in results["runs"]}
    assert runs["t_fails_mid_run"]["status"] == "error"
    assert runs["t_fails_mid_run"]["reason"] == "rank 1: RuntimeError: rank 1's device fell over"
    assert runs["t_fails_to_open"]["status"] == "error"
    assert runs["t_fails_to_open"]["reason"] == "rank 1: RuntimeError: rank 1 cannot open its shard"
    torch_run = runs["torch"]
    assert torch_run["status"] == "ok" and len(torch_run["repeats"]) == 2  # both repeats, after the failures
    assert [r["rank"] for r in torch_run["ranks"]] == [0, 1]
    assert results["ranking"] == [torch_run["label"]]
    assert (out / "decision.json").exists()


DDP_LOOP = """
import json, sys
import torch
import torch.distributed as dist
from loadopt import make_loader
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {}
for shuffle in ("global", "window"):
    for drop_last in (False, True):
        loader = make_loader(sys.argv[1], backend="torch", variant="tuned", num_workers=0, shuffle=shuffle,
                             drop_last=drop_last, window_shards=2, shard_samples=5, batch_size=4)
        seen, steps = [], 0
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader.host_batches():
                step = torch.tensor([1])
                dist.all_reduce(step)  # a collective per batch, as DDP's gradient all-reduce: a rank short of
                steps += 1             # batches would leave the others waiting here for ever
                seen += batch.indices.tolist() if epoch == 0 else []
        gathered = [None] * world
        dist.all_gather_object(gathered, seen)
        out[f"{shuffle} drop_last={drop_last}"] = {"steps": steps, "len": len(loader), "seen": gathered}
        loader.close()
if rank == 0:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def test_three_ranks_take_the_same_batches_so_no_collective_waits(tmp_path, cache_dir):
    """49 samples over 3 ranks in batches of 4: shares of 17, 16 and 16 samples would give one rank 5 batches and
    the others 4, and the fifth all-reduce would wait for ever (WebDataset #188). Every rank takes the same
    batches (one sample padded, or the tail dropped), under both shuffles, for two epochs."""
    config = tiny_config_dict(tmp_path / "out", dataset={"synthetic": {"num_samples": 49, "num_classes": 4,
                                                                       "mean_width": 64, "mean_height": 48}})
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(config))
    script = tmp_path / "ddp_loop.py"
    script.write_text(DDP_LOOP)
    env = {**os.environ, "LOADOPT_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", str(script),
                           str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(text for text in proc.stdout.splitlines() if text.startswith("RESULT "))
    for name, figures in json.loads(line[len("RESULT "):]).items():
        seen = [i for rank in figures["seen"] for i in rank]
        if name.endswith("False"):
            assert figures["len"] == 5 and figures["steps"] == 10, name
            assert set(seen) == set(range(49)) and len(seen) - 49 == 2, name  # 2 samples padded, once each
        else:
            assert figures["len"] == 4 and figures["steps"] == 8, name
            assert len(seen) == len(set(seen)) == 48, name  # one sample of the tail not seen this epoch
