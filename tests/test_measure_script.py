"""The zero-code runner (`loadopt measure SCRIPT`, `python -m loadopt.measure`) and results across ranks."""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import loadopt
from loadopt.loaders.base import HostBatch, Loader, NoSettings
from loadopt.loaders.registry import backend_names
from loadopt.measure import Measurement, measure
from tests.conftest import REPO, tiny_config_dict
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
    from loadopt.measure.__main__ import main

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


LOOP_LINE = re.compile(r"the loop: (\d+) steps, (\d+) samples in ([\d.]+) s")


@pytest.mark.timing  # rates of sleeps and of a short loop: a busy machine stretches them
@pytest.mark.parametrize("backend", backend_names())
def test_loadopt_measure_measures_the_loop_over_make_loader_on_every_backend(tmp_path, capsys, backend):
    """The example's loop over `make_loader`, run by `loadopt measure`: one measurement, of the loadopt loader
    (its batches, as the loop counts them), never a DataLoader that the backend runs inside itself."""
    from loadopt.loaders.registry import backend_class
    from loadopt.measure import run_script

    available, reason = backend_class(backend).available()
    if not available:
        pytest.skip(f"backend {backend} is not available here: {reason}")
    config = tmp_path / "train.yaml"  # 48 samples in batches of 8; torch's tuned ring filled by a worker process
    config.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "out", loaders={
        "torch": {"variant": "tuned", "num_workers": 1}})))
    code = run_script(str(REPO / "examples" / "train_classifier.py"),
                      [str(config), "--backend", backend, "--epochs", "2"], str(tmp_path / "measured"))
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    found = LOOP_LINE.search(stdout)
    assert found, stdout
    steps, samples, loop_s = int(found[1]), int(found[2]), float(found[3])
    assert (steps, samples) == (12, 96)  # two epochs of 6 batches
    doc = json.loads((tmp_path / "measured" / "measure.json").read_text())
    assert [run["label"].split(" (")[0] for run in doc["runs"]] == [backend]  # no inner DataLoader beside it
    metrics = doc["runs"][0]["repeats"][0]
    assert (metrics["batches"], metrics["samples"]) == (steps, samples)  # both epochs, one measurement
    # The measured windows lie inside the loop's own clock; outside them are only the pass boundaries (the
    # measurement's process-tree samples and a pass's worker start: a loop this short, on a machine busy with
    # the rest of the suite, feels them: 4.3x seen). Measuring the backend's inner DataLoader was 29x off.
    loop_rate = samples / loop_s
    assert loop_rate * 0.98 <= metrics["samples_per_s"] <= loop_rate * 10, (metrics, loop_s)
    assert metrics["mb_per_s"] > 0 and metrics["cpu_seconds_per_1k_samples"] > 0


class ThreadedDataLoaderBackend(Loader[NoSettings]):
    """An outside backend (no module of loadopt.loaders) that runs a torch DataLoader on a thread of its own,
    made either when the loader is built or as each pass starts."""

    name = "threaded-dataloader"
    made_in = "init"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.made_in == "init":
            self.inner = self._dataloader()

    def _dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(len(self.dataset))), batch_size=self.pipeline.batch_size)

    def produce(self, batches):
        inner = self.inner if self.made_in == "init" else self._dataloader()
        ready: queue.Queue = queue.Queue()

        def fill() -> None:  # a closure: this thread's stack shows no loader
            for (indices,) in inner:
                ready.put(indices)

        thread = threading.Thread(target=fill, daemon=True)
        thread.start()
        for indices in batches:
            ready.get()  # the inner DataLoader's batch paces this one
            yield HostBatch(torch.zeros((len(indices), 3, 4, 4)), torch.from_numpy(self.dataset.labels[indices]),
                            indices)
        thread.join()


@pytest.mark.parametrize("made_in", ["init", "produce"])
def test_a_dataloader_a_backend_makes_is_not_measured_even_on_its_own_thread(made_in, monkeypatch):
    from loadopt.config import PipelineConfig
    from loadopt.measure.script import MeasureSession
    from tests.backends import memory_dataset

    monkeypatch.setattr(ThreadedDataLoaderBackend, "made_in", made_in)
    session = MeasureSession()
    session.patch()
    try:
        loader = ThreadedDataLoaderBackend(memory_dataset(40), PipelineConfig(batch_size=8, shuffle=False,
                                                                              memory_format="contiguous"))
        own = DataLoader(TensorDataset(torch.zeros(12, 2)), batch_size=4)  # the script's: measured as ever
        for _ in range(2):
            assert sum(len(labels) for _, labels in loader) == 40
            assert sum(len(x) for (x,) in own) == 12
    finally:
        session.unpatch()
    measured = {m.label: m.metrics() for m in session.measurements}
    assert sorted(measured) == ["DataLoader", "threaded-dataloader"]
    assert (measured["threaded-dataloader"]["batches"], measured["threaded-dataloader"]["samples"]) == (10, 80)
    assert (measured["DataLoader"]["batches"], measured["DataLoader"]["samples"]) == (6, 24)
    assert measured["threaded-dataloader"]["mb_per_s"] > 0  # the loader's stored bytes (1,000 a sample)
