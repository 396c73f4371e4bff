"""DALI's faults in the bench: a decoder crash is one failed setting (its run in a child process), a setting
that crashed runs again on the samples checked first, and where it cannot run apart it sees only screened
samples."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from loadopt.cli import app

from .faults import images, write_config


def _bench_folder_with_the_zeroed_jpeg(tmp_path, on_error: str):
    """Photos plus the committed JPEG whose data from its SOS marker on is zeroed: DALI's parser says "Invalid
    marker" (and its CPU decoder has died of a segfault on it); torch's PIL refuses it too."""
    from pathlib import Path

    root, _ = images(tmp_path, corrupt=0)
    fixture = Path(__file__).parent / "fixtures" / "dali_invalid_marker.jpg"
    shutil.copy(fixture, root / "train" / "c0" / "zeroed.jpg")
    return write_config(tmp_path, dataset={"path": str(root), "on_error": on_error},
                        loaders={"torch": {"variant": "plain", "num_workers": 0}, "dali": {"num_threads": 1}})


def test_a_dali_crash_is_one_failed_setting_and_the_torch_rows_are_kept(tmp_path, own_cache, monkeypatch):
    """DALI's run goes into a child process: its crash (a segfault, forced here in DALI's decoding) is dali's
    failed setting with its signal; torch's rows and the decision among what was measured are written."""
    from loadopt.loaders.dali.loader import DaliLoader

    if not DaliLoader.available()[0]:
        pytest.skip(DaliLoader.available()[1])
    config = _bench_folder_with_the_zeroed_jpeg(tmp_path, "skip")
    real = DaliLoader.produce

    def crashes(self, batches):
        os.kill(os.getpid(), signal.SIGSEGV)  # in the child the bench forked for this run
        yield from real(self, batches)

    monkeypatch.setattr(DaliLoader, "produce", crashes)
    result = CliRunner().invoke(app, ["bench", str(config), "--quick", "--loaders", "torch,dali"])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    runs = {r["backend"]: r for r in results["runs"]}
    assert runs["torch"]["status"] == "ok" and runs["torch"]["repeats"][0]["samples_per_s"] > 0
    assert runs["dali"]["status"] == "error" and "crashed (signal SIGSEGV)" in runs["dali"]["reason"], runs["dali"]
    assert results["ranking"] == [runs["torch"]["label"]] and "in_progress" not in results
    assert json.loads((tmp_path / "results" / "decision.json").read_text())["backend"] == "torch"


def test_the_zeroed_jpeg_under_dali_is_skipped_and_counted_and_torch_kept(tmp_path, own_cache):
    """The real fixture, no forcing: DALI (in its child) skips it under on_error: skip, counted; never dies."""
    from loadopt.loaders.dali.loader import DaliLoader

    if not DaliLoader.available()[0]:
        pytest.skip(DaliLoader.available()[1])
    config = _bench_folder_with_the_zeroed_jpeg(tmp_path, "skip")
    result = CliRunner().invoke(app, ["bench", str(config), "--quick", "--loaders", "torch,dali"])
    assert result.exit_code == 0, result.output
    runs = {r["backend"]: r for r in json.loads((tmp_path / "results" / "results.json").read_text())["runs"]}
    assert runs["torch"]["status"] == "ok"
    dali = runs["dali"]  # DALI's own failure, or (where its decoder crashed on it) PIL's refusal on the rerun
    assert dali["status"] == "ok" and [s["path"].endswith("zeroed.jpg") for s in dali["skipped_files"]] == [True]
    assert dali["skipped_files"][0]["times"] >= 1


def test_a_dali_run_that_crashed_runs_again_on_the_samples_checked_first(tmp_path, own_cache, monkeypatch, caplog):
    """DALI's decoder has died of a segfault on the zeroed JPEG (forced here until the samples are screened): the
    setting runs again, in a new child, on the samples PIL decodes; the zeroed file is then a named failure under
    on_error, and the setting has its figures."""
    from loadopt.loaders.dali.loader import DaliLoader

    if not DaliLoader.available()[0]:
        pytest.skip(DaliLoader.available()[1])
    import logging

    caplog.set_level(logging.WARNING, logger="loadopt.bench.runner")
    config = _bench_folder_with_the_zeroed_jpeg(tmp_path, "skip")
    real_produce, real_screen = DaliLoader.produce, DaliLoader.screen_samples

    def screening(self, progress=None):
        self.checked_first = True
        return real_screen(self, progress)

    def crashes_unless_checked(self, batches):
        if not getattr(self, "checked_first", False):
            os.kill(os.getpid(), signal.SIGSEGV)  # in the child the bench forked for this run
        yield from real_produce(self, batches)

    monkeypatch.setattr(DaliLoader, "screen_samples", screening)
    monkeypatch.setattr(DaliLoader, "produce", crashes_unless_checked)
    result = CliRunner().invoke(app, ["bench", str(config), "--quick", "--loaders", "torch,dali"])
    assert result.exit_code == 0, result.output
    assert "crashed (signal SIGSEGV)" in caplog.text and "running it again on the samples checked first" in \
        caplog.text, caplog.text
    runs = {r["backend"]: r for r in json.loads((tmp_path / "results" / "results.json").read_text())["runs"]}
    dali = runs["dali"]
    assert dali["status"] == "ok" and dali["repeats"][0]["samples_per_s"] > 0, dali
    (skipped,) = dali["skipped_files"]
    assert skipped["path"].endswith("zeroed.jpg") and skipped["reason"].startswith("refused before DALI saw it")


def test_dali_where_it_cannot_run_apart_sees_only_screened_samples(tmp_path, own_cache, monkeypatch):
    """Where a DALI run cannot go into a child process (a CUDA device, torchrun: forced here), every sample is
    decoded once by PIL first (cached per dataset): the zeroed JPEG is a named failure DALI never saw, skipped and
    counted under on_error: skip; under on_error: raise it is the bench's one line naming it."""
    from loadopt.bench import runner
    from loadopt.loaders.dali.loader import DaliLoader

    if not DaliLoader.available()[0]:
        pytest.skip(DaliLoader.available()[1])
    config = _bench_folder_with_the_zeroed_jpeg(tmp_path, "skip")
    monkeypatch.setattr(runner, "can_run_apart", lambda device, world_size: False)
    seen: list[int] = []
    real = DaliLoader._new_pipeline

    def counting(self, source, depth=None):  # the batches DALI is handed: never the zeroed file's index
        seen.append(1)
        return real(self, source, depth)

    monkeypatch.setattr(DaliLoader, "_new_pipeline", counting)
    result = CliRunner().invoke(app, ["bench", str(config), "--quick", "--loaders", "torch,dali"])
    assert result.exit_code == 0, result.output
    runs = {r["backend"]: r for r in json.loads((tmp_path / "results" / "results.json").read_text())["runs"]}
    assert runs["torch"]["status"] == "ok" and runs["dali"]["status"] == "ok", runs["dali"]
    (skipped,) = runs["dali"]["skipped_files"]
    assert skipped["path"].endswith("zeroed.jpg") and skipped["reason"].startswith(
        "refused before DALI saw it: PIL cannot decode it ("), skipped
    assert seen and list((own_cache / "screened").glob("*.json"))
    raising = _bench_folder_with_the_zeroed_jpeg(tmp_path / "raise", "raise")
    result = CliRunner().invoke(app, ["bench", str(raising), "--quick", "--loaders", "dali"])
    assert result.exit_code == 1, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: {tmp_path / 'raise' / 'photos' / 'train' / 'c0' / 'zeroed.jpg'}: refused before DALI saw it: PIL "
        f"cannot decode it ({skipped['reason'].split('PIL cannot decode it (', 1)[1]} (set dataset.on_error: skip "
        "to skip it)"]


def test_dali_tuning_trials_see_only_screened_samples(tmp_path, own_cache, monkeypatch):
    """`--tune` runs its trials in the bench's process (no child): DALI's trials get the samples PIL checked first,
    so a JPEG that could crash its decoder is a named failure there too, never a crash of the tuning."""
    from loadopt.loaders.dali.loader import DaliLoader

    if not DaliLoader.available()[0]:
        pytest.skip(DaliLoader.available()[1])
    config = _bench_folder_with_the_zeroed_jpeg(tmp_path, "skip")
    events: list[str] = []
    real_screen, real_pipeline = DaliLoader.screen_samples, DaliLoader._new_pipeline

    def noting(self, progress=None):
        events.append("screened")
        return real_screen(self, progress)

    def building(self, source, depth=None):  # a pipeline: DALI is about to be handed samples
        events.append("pipeline")
        return real_pipeline(self, source, depth)

    monkeypatch.setattr(DaliLoader, "screen_samples", noting)
    monkeypatch.setattr(DaliLoader, "_new_pipeline", building)
    result = CliRunner().invoke(app, ["bench", str(config), "--quick", "--loaders", "dali", "--tune", "--budget",
                                      "8s"])
    assert result.exit_code == 0, result.output
    assert events and events[0] == "screened", events  # the first trial's pipeline came after the screening
    (saved,) = (own_cache / "screened").glob("*.json")
    refused = json.loads(saved.read_text())["refused"]
    assert len(refused) == 1 and "PIL cannot decode it" in next(iter(refused.values())), refused


DALI_AFTER_OPENMP = """
import sys
import torch
from loadopt.loaders.dali.loader import DaliLoader
torch.set_num_threads(2)
torch.cat([torch.ones(2_000_000)] * 2)  # an OpenMP team on this main thread, as the torch rows before DALI's leave it
real = DaliLoader.produce
def produce(self, batches):  # a parallel torch op where DALI's loader makes them: isolating a damaged sample
    torch.cat([torch.ones(2_000_000)] * 2)
    yield from real(self, batches)
DaliLoader.produce = produce
from loadopt.cli import main
sys.argv = ["loadopt", "bench", sys.argv[1], "--quick", "--loaders", "dali"]
main()
"""


def test_dali_in_its_child_after_openmp_work_in_the_parent_does_not_hang(tmp_path, own_cache):
    """The fork copies the parent main thread's OpenMP team without its threads: DALI's child, on its main thread,
    waited on them for good at its first parallel torch op (isolating a damaged sample's batch: a 300-photo bench
    hung). The run goes in a thread of its own in the child."""
    from loadopt.loaders.dali.loader import DaliLoader

    if not DaliLoader.available()[0]:
        pytest.skip(DaliLoader.available()[1])
    root, _ = images(tmp_path, corrupt=1)
    config = write_config(tmp_path, dataset={"path": str(root), "on_error": "skip"},
                          pipeline={"batch_size": 8, "image_size": 96}, loaders={"dali": {"num_threads": 1}})
    try:
        done = subprocess.run([sys.executable, "-c", DALI_AFTER_OPENMP, str(config)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "LOADOPT_CACHE": str(own_cache)})
    except subprocess.TimeoutExpired:
        pytest.fail("the bench hung in DALI's child process")
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((tmp_path / "results" / "results.json").read_text())["runs"]
    assert [r["status"] for r in runs] == ["ok"] and len(runs[0]["skipped_files"]) == 1, runs
