"""`torchrun --nnodes 2 ... -m loadopt tiers`: every rank one accelerator, rank 0 searching; the same answer as
one process with forked consumers, for a tier of known capacity."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import yaml

from loadopt.config import config_from_dict
from loadopt.procurement.plan import demand
from loadopt.storage.open import open_dataset

from .conftest import REPO

AU = 0.9


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_over_torchrun_find_what_one_process_finds(tmp_path, cache_dir):
    raw = {"name": "rec", "dataset": {"kind": "records", "records": {
        "record_bytes": 8_000, "record_bytes_stdev": 0, "samples_per_file": 8, "num_files": 16, "file_format": "raw",
        "delivered_bytes": 4_000}}, "pipeline": {"batch_size": 4}, "workload": {"step_time_ms": 20},
        "loaders": {"torch": {"num_workers": 0}}}
    need = demand(config_from_dict(raw, "x.yaml"), 8_000.0, AU)["mb_per_s_at_threshold"]
    # A tier that keeps 3 accelerators at AU >= 0.9 (halfway between 3 and 4 accelerators' need).
    raw["storage"] = {"tier": {"name": "bw3", "bandwidth_mb_s": 3.5 * need, "latency_ms": 1.0}}
    path = tmp_path / "rec.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "LOADOPT_CACHE": str(cache_dir), "COLUMNS": "200", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    common = ["tiers", str(path), "--max-accelerators", "4", "--no-backends", "--measure", "0.8", "--warmup", "0.3"]
    # The records generated (and listed) here first: the single process and the torchrun job then run side by side
    # (each trial reads a tier instance of its own, and their consumers take a few % of a core) on the same files.
    open_dataset(config_from_dict(raw, str(path)))
    single = subprocess.Popen([sys.executable, "-m", "loadopt", *common, "--out", str(tmp_path / "single")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                               "-m", "loadopt", *common, "--out", str(tmp_path / "multi")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=600) for node in nodes]
        _, single_err = single.communicate(timeout=600)
    finally:
        for proc in (single, *nodes):
            if proc.poll() is None:
                proc.kill()
    assert single.returncode == 0, single_err
    assert [node.returncode for node in nodes] == [0, 0], outputs
    one = json.loads((tmp_path / "single" / "tiers.json").read_text())["tiers"][0]
    result = json.loads((tmp_path / "multi" / "tiers.json").read_text())
    assert result["consumer"]["torchrun"] == {"ranks": 4, "nodes": 2,
                                              "note": "each rank one emulated accelerator (procurement/ranks.py)"}
    many = result["tiers"][0]
    # the truth is 3 by construction; one process and the torchrun job each find it (within one accelerator)
    assert abs(one["accelerators_supported"] - 3) <= 1, one["trials"]
    assert abs(many["accelerators_supported"] - 3) <= 1, many["trials"]
    at = next(t for t in many["trials"] if t["accelerators"] == many["accelerators_supported"])
    assert at["accelerator_utilisation"] >= AU
    assert "bw3" in outputs[0][0]  # rank 0 printed the table; node 1's ranks print nothing of it
    assert "bw3" not in outputs[1][0]
