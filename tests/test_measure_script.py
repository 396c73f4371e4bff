"""The zero-code runner (`loadopt measure SCRIPT`, `python -m loadopt.measure`) and results across ranks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader

import loadopt
from loadopt.measure import Measurement, measure
from tests.conftest import REPO
from tests.test_measure import run_loop, sleepy


def test_loadopt_measure_stays_the_function_once_the_subpackage_is_imported():
    import importlib

    import loadopt.measure as module

    importlib.import_module("loadopt.measure.script")  # a submodule imported later changes nothing either

    assert loadopt.measure is module  # `import a.b as m` reads the attribute: the function, not the package
    m = loadopt.measure([torch.zeros(2)], summary=False)
    assert isinstance(m, Measurement) and len(list(m)) == 1
    assert isinstance(loadopt.measure_steps(), Measurement)


def test_ranks_gather_and_name_the_slowest(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, delay in ((1, 0.01), (0, 0.0)):
        monkeypatch.setenv("RANK", str(rank))
        m = measure(sleepy(5, delay), summary=False, out=tmp_path)
        run_loop(m, 0.002)
    assert (tmp_path / "measure-rank0.json").exists() and (tmp_path / "measure-rank1.json").exists()
    doc = json.loads((tmp_path / "measure.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["rank 0", "rank 1"]
    assert doc["slowest_rank"] == 1 and doc["missing_ranks"] == [] and doc["world_size"] == 2
    assert "slowest: rank 1" in doc["summary"]

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    m = Measurement([torch.zeros(1)], summary=False, rank_wait_s=0.2)
    list(m)
    started = time.monotonic()
    doc = json.loads(m.write(tmp_path / "three").read_text())
    assert time.monotonic() - started < 2
    assert doc["missing_ranks"] == [1, 2] and doc["runs"][2]["status"] == "missing" and doc["slowest_rank"] == 0


SCRIPT = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
train = DataLoader(TensorDataset(torch.zeros(24, 2)), batch_size=4)
val = DataLoader(TensorDataset(torch.zeros(8, 2)), batch_size=4)
for epoch in range(2):
    for (x,) in train:
        pass
    for (x,) in val:
        pass
assert sys.argv[1:] == ["--flag", "value"], sys.argv
{ending}
"""


@pytest.mark.parametrize("ending, code", [("", 0), ("sys.exit(3)", 3), ("raise RuntimeError('script failed')", 1)])
def test_zero_code_form_in_process(tmp_path, capsys, caplog, ending, code):
    from loadopt.measure import run_script

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(ending=ending))
    original = DataLoader.__iter__
    with caplog.at_level(logging.INFO, logger="loadopt.measure"):
        assert run_script(str(script), ["--flag", "value"], str(tmp_path / "out")) == code
    assert DataLoader.__iter__ is original
    doc = json.loads((tmp_path / "out" / "measure.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["DataLoader", "DataLoader #2"]
    assert [r["repeats"][0]["batches"] for r in doc["runs"]] == [12, 4]  # two epochs each
    assert "measure DataLoader: 12 steps" in caplog.text
    if code == 1:
        assert "RuntimeError: script failed" in capsys.readouterr().err


def test_zero_code_user_errors(tmp_path, capsys):
    from loadopt.measure import main

    assert main([str(tmp_path / "missing.py")]) == 1
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing.py'}: no such script"
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["--out", str(blocker / "out"), str(script)]) == 1
    err = capsys.readouterr()
    assert err.err.startswith("error: ") and "a-file" in err.err and "ran" not in err.out


def test_loadopt_measure_command_passes_the_script_its_arguments_and_keeps_its_exit_status(tmp_path):
    """`loadopt measure SCRIPT ARGS`: everything after the script is the script's, even our own option names."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace('["--flag", "value"]', '["--out", "mine", "--every", "2"]').format(
        ending="sys.exit(3)"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "loadopt", "measure", "--out", str(tmp_path / "out"), str(script),
                           "--out", "mine", "--every", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert "measure DataLoader: 12 steps" in done.stderr and "measure DataLoader #2: 4 steps" in done.stderr
    assert "step 2:" not in done.stderr  # the script's --every 2 was not ours
    doc = json.loads((tmp_path / "out" / "measure.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["DataLoader", "DataLoader #2"]
    assert not (tmp_path / "mine").exists()
    missing = subprocess.run([sys.executable, "-m", "loadopt", "measure", str(tmp_path / "missing.py")], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and missing.stderr.strip() == f"error: {tmp_path / 'missing.py'}: no such script"


def test_python_dash_m_loadopt_measure_on_the_example(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "loadopt.measure", "--out", str(tmp_path), "--every", "5",
                           "examples/measure_loop.py", "--steps", "10"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "10 steps in" in done.stdout  # the script ran, unmodified, with its arguments
    assert "measure DataLoader: 10 steps" in done.stderr and "step 5:" in done.stderr
    assert "Traceback" not in done.stderr
    doc = json.loads((tmp_path / "measure.json").read_text())
    assert doc["runs"][0]["label"] == "DataLoader" and doc["steps"] == 10
