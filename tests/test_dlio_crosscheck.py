"""benchmarks/dlio_crosscheck.py without DLIO: its reading of DLIO's per-step output, loadopt's side on files in
DLIO's npz layout, and the honest exit where DLIO is not installed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def crosscheck():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("dlio_crosscheck", BENCH / "dlio_crosscheck.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def test_dlio_figures_skip_the_first_epoch_and_count_every_step_of_the_rest(crosscheck, tmp_path):
    # Each epoch's elapsed time comes from the throughput DLIO records for it (steps x batch / elapsed):
    # 2 steps of 4 at 32 samples/s is 0.25 s an epoch, so epochs 2 and 3 took 0.5 s.
    steps = {"1": {"proc": {"block1": [5.0, 0.1]}, "compute": {"block1": [0.05, 0.05]},
                   "throughput": {"block1": 1.5}},
             "2": {"proc": {"block1": [0.2, 0.1]}, "compute": {"block1": [0.05, 0.05]},
                   "throughput": {"block1": 32.0}},
             "3": {"proc": {"block1": [0.1, 0.1]}, "compute": {"block1": [0.05, 0.05]},
                   "throughput": {"block1": 32.0}}, "hostname": "x"}
    (tmp_path / "0_output.json").write_text(json.dumps(steps))
    (tmp_path / "summary.json").write_text(json.dumps({"metric": {
        "train_au_percentage": [1.0, 40.0, 50.0], "train_throughput_samples_per_second": [1.0, 30.0, 40.0]}}))
    figures = crosscheck.dlio_figures(tmp_path, batch=4)
    assert figures["au"] == pytest.approx(0.2 / 0.5)  # epoch 1 left out
    assert figures["samples_per_s"] == pytest.approx(16 / 0.5)
    assert figures["steps_share"] == pytest.approx(0.5 / 0.5)
    assert figures["own_au"] == pytest.approx(0.45) and figures["own_samples_per_s"] == pytest.approx(35.0)


def test_loadopt_reads_dlio_npz_files_through_the_imported_workload(crosscheck, tmp_path, monkeypatch):
    monkeypatch.setattr(crosscheck, "FILES", 8)
    monkeypatch.setattr(crosscheck, "RESIZE_BYTES", 1024)
    train = tmp_path / "data" / "train"
    train.mkdir(parents=True)
    for index in range(8):  # DLIO's npz generator: x of (dim1, dim2, samples) uint8, its file naming
        np.savez(train / f"img_{index}_of_8.npz", x=np.full((40, 40, 1), index, np.uint8), y=np.zeros(1))
    workload_file = tmp_path / "xcheck.yaml"
    workload_file.write_text(yaml.safe_dump(crosscheck.workload(tmp_path / "data", 0.002, epochs=2)))
    figures = crosscheck.loadopt_figures(workload_file, train, epochs=2)
    assert 0.0 < figures["au"] <= 1.0 and figures["samples_per_s"] > 0
    assert figures["au"] == pytest.approx(figures["samples_per_s"] / crosscheck.BATCH * 0.002)
    costs = crosscheck.read_costs(workload_file, train)
    assert costs["loadopt"] > 0 and costs["dlio"] > 0


def test_without_dlio_it_says_how_to_install_and_prints_no_result(crosscheck, monkeypatch, capsys):
    monkeypatch.setattr(crosscheck, "find_dlio", lambda given: None)
    monkeypatch.setattr(sys, "argv", ["dlio_crosscheck.py"])
    assert crosscheck.main() == 0
    out = capsys.readouterr().out
    assert "dlio_benchmark is not installed" in out and "pip install" in out and "RESULT" not in out
