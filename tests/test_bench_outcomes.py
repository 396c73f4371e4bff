"""What `loadopt bench` leaves when a dataset holds a damaged file: every backend and form under
`dataset.on_error: raise` (one line naming the file, the output folder as it was) and `skip` (measured,
the file listed); a bench that measured part writes a consistent set, with each setting's true reason."""

from __future__ import annotations

import hashlib
import json
import typing
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from loadopt.bench import decision
from loadopt.cli import app
from loadopt.errors import DatasetError
from loadopt.loaders.registry import backend_class, backend_names, register, unregister
from loadopt.schema.documents import decision_text

from .backends import DelayLoader
from .conftest import make_image_folder
from .faults import said, write_config


def forms(backend: str) -> tuple[str | None, ...]:
    """The values of a backend's `form` knob (what it stores or reads), or None where it has none."""
    field = backend_class(backend).Settings.model_fields.get("form")
    return typing.get_args(field.annotation) if field is not None else (None,)


BUILT_IN = [name for name in backend_names() if name != "example_jpeg"]
FORMS = [(name, form) for name in BUILT_IN for form in forms(name)]
QUICK = {"warmup_batches": 1, "measure_batches": 3, "repeats": 1}


def truncated_image_folder(tmp_path: Path) -> tuple[Path, Path]:
    """Ten good JPEGs and one cut in half (a download that stopped): its header reads, its scan does not."""
    root = tmp_path / "photos"
    make_image_folder(root, classes=2, per_class=5)
    good = (root / "train" / "c0" / "0.jpg").read_bytes()
    bad = root / "train" / "c0" / "cut.jpg"
    bad.write_bytes(good[: len(good) // 2])
    return root, bad


def folder_state(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def bench(config: Path, *args: str):
    return CliRunner().invoke(app, ["bench", str(config), "--quick", *args])


def loaders_section(backend: str, form: str | None) -> dict:
    settings: dict = {"form": form} if form else {}
    if backend in ("torch", "webdataset", "streaming", "litdata", "ffcv"):
        settings["num_workers"] = 0
    return {backend: settings}


@pytest.mark.parametrize(("backend", "form"), FORMS, ids=[f"{b}-{f}" if f else b for b, f in FORMS])
def test_a_damaged_file_under_raise_and_skip_through_every_backend_and_form(tmp_path, own_cache, backend, form):
    cls = backend_class(backend)
    if not cls.available()[0]:
        pytest.skip(f"{backend}: {cls.available()[1]}")
    root, bad = truncated_image_folder(tmp_path)
    out = tmp_path / "results"
    for policy in ("raise", "skip"):
        config = write_config(tmp_path, dataset={"path": str(root), "on_error": policy},
                              loaders=loaders_section(backend, form), workload=QUICK)
        result = bench(config)
        text = said(result)
        assert "Traceback" not in result.output
        if policy == "raise":  # the damaged file named, and nothing was measured: no results folder
            assert result.exit_code == 1, result.output
            assert f"error: {bad}:" in text and "dataset.on_error: skip" in text, text
            assert not out.exists(), sorted(p.name for p in out.iterdir())
            continue
        assert result.exit_code == 0, result.output
        results = json.loads((out / "results.json").read_text())
        (run,) = results["runs"]
        assert run["status"] == "ok", run
        assert [f["path"] for f in run["skipped_files"]] == [str(bad)], run["skipped_files"]
        assert "1 unreadable file(s) skipped (dataset.on_error: skip)" in text
        if form is not None:
            assert run["settings"]["form"] == form


def test_a_bench_that_measured_nothing_leaves_the_previous_results_as_they_were(tmp_path, own_cache):
    root, bad = truncated_image_folder(tmp_path)
    torch_only = {"torch": {"variant": "plain", "num_workers": 0}}
    good = write_config(tmp_path, dataset={"path": str(root), "on_error": "skip"}, loaders=torch_only, workload=QUICK)
    out = tmp_path / "results"
    assert bench(good).exit_code == 0
    before = folder_state(out)
    assert set(before) == {"results.json", "timings.parquet", "report.html", "decision.json"}
    failing = write_config(tmp_path, dataset={"path": str(root), "on_error": "raise"},
                           loaders={**torch_only, "arrow": {"form": "decoded"}}, workload=QUICK)
    for loaders in ("torch", "arrow", "torch,arrow"):  # failing at run time, at conversion, both
        result = bench(failing, "--loaders", loaders)
        assert result.exit_code == 1 and f"error: {bad}:" in said(result), result.output
        assert folder_state(out) == before, loaders
    register("t_unavailable")(Unavailable)
    try:  # every setting unavailable: the reasons printed, nothing written
        unavailable = bench(write_config(tmp_path, loaders={"t_unavailable": {}}, workload=QUICK))
    finally:
        unregister("t_unavailable")
    assert unavailable.exit_code == 1 and folder_state(out) == before
    assert f"needs the frobnicator driver, not installed here); nothing was written to {out}" in said(unavailable)


class Unavailable(DelayLoader):
    @classmethod
    def available(cls):
        return False, "needs the frobnicator driver, not installed here"


class DamagedAfterOneRun(DelayLoader):
    """A backend whose second setting meets a damaged file, as `on_error: raise` reports one."""

    def produce(self, batches):
        if self.settings.delay_s > 0.001:
            raise DatasetError("broken.jpg: damaged JPEG (set dataset.on_error: skip to skip it)")
        yield from super().produce(batches)


@pytest.fixture
def damaged_after_one_run():
    register("t_damaged")(DamagedAfterOneRun)
    yield
    unregister("t_damaged")


def test_a_bench_stopped_by_an_error_after_a_run_writes_a_consistent_set(tmp_path, own_cache, damaged_after_one_run):
    """The measured run, the failing setting's error and the setting after it (never run) with why; the
    report of these results; a decision among what was measured, marked partial, beside them (the earlier
    bench's replaced) but not in the cache, so `auto` keeps the finished bench's answer."""
    out = tmp_path / "results"
    earlier = write_config(tmp_path, loaders={"t_damaged": {"delay_s": 0.001}}, workload=QUICK)
    assert bench(earlier).exit_code == 0
    assert (out / "decision.json").exists()
    report_before = (out / "report.html").read_text()
    config = write_config(tmp_path, loaders={"t_damaged": {"delay_s": [0.001, 0.002, 0.003]}}, workload=QUICK)
    result = bench(config)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: broken.jpg: damaged JPEG"), result.output
    results = json.loads((out / "results.json").read_text())
    assert results["interrupted"] is False
    partial = results["decision"]
    assert partial["partial"] is True and partial["label"] == results["ranking"][0]
    assert partial["not_compared"] == [r["label"] for r in results["runs"][1:]]
    assert partial["text"].startswith("partial (stopped at an error; 1 of 3 settings measured"), partial["text"]
    statuses = [(r["status"], r["reason"]) for r in results["runs"]]
    assert statuses[0] == ("ok", "")
    assert statuses[1] == ("error", "broken.jpg: damaged JPEG (set dataset.on_error: skip to skip it)")
    assert statuses[2] == ("not run", "the bench stopped at an error before this setting ran: broken.jpg: "
                                      "damaged JPEG (set dataset.on_error: skip to skip it)")
    assert json.loads((out / "decision.json").read_text()) == json.loads(decision_text(partial))
    cached = json.loads(decision.decision_path(results["dataset"]["fingerprint"]).read_text())["entries"]
    assert [e.get("partial", False) for e in cached] == [False], "a partial decision reached the cache"
    report = (out / "report.html").read_text()
    assert report != report_before and "delay_s=0.003" in report
    assert set(pq.read_table(out / "timings.parquet").column("label").to_pylist()) == {results["ranking"][0]}
