"""`loadopt report`: the HTML page and the Markdown summary, on a tiny real bench and on recorded fixtures.

The page is checked three ways: parsed strictly (it is well-formed XML), searched for anything that
would reach outside the file, and rendered in a real headless Chromium driven over the DevTools
protocol (on a pipe: no port, no extra package), which also reports console errors and requests.
Set LOADOPT_UPDATE_GOLDEN=1 to rewrite the golden Markdown files after a deliberate change.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from loadopt.errors import LoadoptError, OutputError
from loadopt.report import ReportError, ResultsFileError, render_report, write_report

from .browser import CHROMIUM, Browser, not_blank
from .conftest import tiny_config_dict
from .test_cli import loadopt

FIXTURES = Path(__file__).parent / "fixtures"
TIERS = FIXTURES / "bench_tiers"  # a recorded bench (3 settings + 1 unavailable) with ceilings, verdicts, tiers
AFTER = FIXTURES / "bench_after"  # the same job on another machine, no timings
MEASURE = FIXTURES / "measure"  # a loadopt.measure results file
SECTIONS = ("ranking", "time", "latency", "over-time", "decision", "machine")


@pytest.fixture(scope="module")
def real_bench(tmp_path_factory, cache_dir):
    """A tiny real bench through the CLI (2 backends, 2 repeats): its report is written automatically."""
    tmp = tmp_path_factory.mktemp("bench")
    config = tiny_config_dict(tmp / "out", loaders={"torch": {"variant": ["plain", "tuned"], "num_workers": 0},
                                                    "arrow": {"form": "decoded"}},
                              workload={"repeats": 2, "measure_batches": 5})
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = loadopt("bench", path, env_cache=cache_dir)
    assert proc.returncode == 0, proc.stderr
    return tmp / "out", proc.stdout


def parse(page: str) -> ET.Element:
    """Strict: the page is well-formed XML (and so balanced HTML); unclosed or stray tags fail here."""
    return ET.fromstring(page.split("\n", 1)[1] if page.startswith("<!DOCTYPE html>") else page)


def assert_self_contained(page: str, root: ET.Element) -> None:
    for el in root.iter():
        for name, value in el.attrib.items():
            if name.rsplit("}", 1)[-1] in ("src", "href", "srcset", "action", "data", "poster"):
                assert value.startswith("#"), f"<{el.tag} {name}={value!r}> points outside the page"
    # (`file:` as a scheme, not the end of a key such as `samples_per_file:` in the config shown)
    assert not re.search(r"https?://|(?<![\w])file:|url\((?!#)|@import|<script|<link|<img|<iframe", page), \
        "an outside reference"
    ids = [el.get("id") for el in root.iter() if el.get("id")]
    assert len(ids) == len(set(ids)), "duplicate ids"
    targets = {m for m in re.findall(r'href="#([^"]+)"', page)} | set(re.findall(r"url\(#([^)]+)\)", page))
    assert targets <= set(ids), f"references to missing ids: {sorted(targets - set(ids))[:5]}"


def sections(root: ET.Element) -> dict[str, ET.Element]:
    return {el.get("data-section"): el for el in root.iter("section")}


def svgs(section: ET.Element) -> list[ET.Element]:
    return list(section.iter("svg"))


def texts(el: ET.Element) -> str:
    return " ".join(t.strip() for t in el.itertext() if t.strip())


def test_bench_writes_the_report_and_every_section_renders(real_bench):
    out, stdout = real_bench
    report = out / "report.html"
    assert f"report: {report}" in stdout.replace("\n", "")
    page = report.read_text()
    root = parse(page)
    assert_self_contained(page, root)
    found = sections(root)
    assert set(found) == set(SECTIONS)  # no tiers in a bench's results
    for key in ("ranking", "time", "latency", "over-time"):
        assert svgs(found[key]), key
    results = json.loads((out / "results.json").read_text())
    for label in results["ranking"]:
        assert label in texts(found["ranking"]) and label in texts(found["over-time"])
    assert "Ceilings were not measured" not in texts(found["ranking"])  # the bench measures them now
    assert "of decode" in texts(found["ranking"])
    for verdict in results["verdicts"]:
        assert verdict["label"] in texts(found["decision"])
    assert results["summary"] in texts(found["decision"])
    # Axes are labelled with units.
    for unit in ("samples/s", "ms, mean over measured batches", "wait for a batch (ms", "wait (ms)"):
        assert unit in page, unit
    assert "repeat 1 of 2" in page or "repeat 2 of 2" in page  # the timeline shows the median repeat


def test_fixture_with_ceilings_verdicts_and_tiers():
    page = render_report([TIERS])
    root = parse(page)
    assert_self_contained(page, root)
    found = sections(root)
    assert set(found) == {*SECTIONS, "tiers"}
    assert len(svgs(found["tiers"])) == 3  # supported per tier, AU against count, cost per accelerator
    tiers_text = texts(found["tiers"])
    for text in ("local NVMe", "NFS share", "S3 (emulated, 40 ms latency)", "accelerators kept at AU", "$4.46",
                 "accelerator utilisation (%)", "emulated accelerators (count)", "AU threshold 90%"):
        assert text in tiers_text, text
    ranking = texts(found["ranking"])
    assert "56% of decode rate x cores" in ranking and "ceiling that bounds it" in ranking
    assert "Ceilings were not measured" not in ranking
    assert "dali" in ranking and "No module named 'nvidia'" in ranking
    decision = texts(found["decision"])
    assert "Use arrow decoded 256px threads=2 prefetch=2" in decision
    assert "prep-bound: PIL decoding on 2 cores delivers 724 samples/s" in decision
    machine = texts(found["machine"])
    assert "bench-host" in machine and "torch 2.13.0+cpu" in machine and "kvikio-cu12: not installed" in machine
    assert "batch_size: 64" in machine  # the config, as run


def test_measure_results_render_with_what_they_have():
    page = render_report([MEASURE])
    root = parse(page)
    assert_self_contained(page, root)
    found = sections(root)
    assert set(found) == set(SECTIONS)
    assert svgs(found["ranking"]) and svgs(found["time"])
    for key in ("latency", "over-time"):
        assert "timings.parquet is not beside the results file" in texts(found[key]), key
    assert "waited for data 53% of the wall time" in texts(found["decision"])
    assert "No config in this results file" in texts(found["machine"])
    assert "| 1 | `DataLoader` | 1,231 |" in render_report([MEASURE], "markdown")


def test_comparison_side_by_side_with_ratios():
    page = render_report([TIERS, AFTER])
    root = parse(page)
    assert_self_contained(page, root)
    found = sections(root)
    assert set(found) == {"comparison", *SECTIONS, "tiers"}
    comparison = texts(found["comparison"])
    assert "bench-host" in comparison and "big-host" in comparison and "AMD EPYC 9654, 16 cores" in comparison
    assert "3.10x" in comparison and "2.00x" in comparison  # B against A, per common loader setting
    assert "torch plain num_workers=2 prefetch=2" not in comparison.split("B/A", 1)[1]  # only in A: not compared
    for key in SECTIONS:
        assert len([d for d in found[key].iter("div") if d.get("class") == "file"]) == 2, key
    assert "This results file has no storage tiers." in texts(found["tiers"])  # B has none


@pytest.mark.parametrize(("paths", "golden"), [([TIERS], "report_golden.md"),
                                               ([TIERS, AFTER], "report_compare_golden.md")])
def test_markdown_matches_the_golden_file(paths, golden):
    text = render_report(paths, "markdown")
    if os.environ.get("LOADOPT_UPDATE_GOLDEN"):
        (FIXTURES / golden).write_text(text)
    assert text == (FIXTURES / golden).read_text()


def test_output_defaults_atomic_and_errors(tmp_path):
    folder = tmp_path / "res"
    shutil.copytree(TIERS, folder)
    assert write_report([folder]) == folder / "report.html"  # beside the results file; a folder is accepted
    assert write_report([folder / "results.json"], fmt="markdown") == folder / "report.md"
    assert write_report([folder], tmp_path / "sub" / "r.html").is_file()
    assert not [p for p in tmp_path.rglob("*.tmp")]
    with pytest.raises(ResultsFileError, match=r"missing\.json: no such results file"):
        write_report([tmp_path / "missing.json"])
    (tmp_path / "bad.json").write_text('{"runs": [')
    with pytest.raises(ResultsFileError, match=r"bad\.json: not valid JSON"):
        write_report([tmp_path / "bad.json"])
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(ResultsFileError, match=r"other\.json: not a loadopt results file"):
        write_report([tmp_path / "other.json"])
    with pytest.raises(ResultsFileError, match="no results.json or measure.json"):
        write_report([tmp_path / "sub"])
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match=r"file/r\.html: cannot write the report"):
        write_report([folder], tmp_path / "file" / "r.html")
    with pytest.raises(ReportError, match="--format pdf: unknown"):
        write_report([folder], fmt="pdf")
    # A damaged timings file costs the per-batch sections only.
    (folder / "timings.parquet").write_bytes(b"not parquet")
    page = render_report([folder])
    assert "the per-batch timings could not be read (timings.parquet" in page
    assert issubclass(ResultsFileError, LoadoptError)


def test_cli_report_and_markdown(tmp_path):
    out = tmp_path / "r.html"
    proc = loadopt("report", TIERS / "results.json", AFTER, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout.replace("\n", "") and out.is_file()
    proc = loadopt("report", TIERS, "--format", "markdown")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (FIXTURES / "report_golden.md").read_text()
    proc = loadopt("report", tmp_path / "nope.json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {tmp_path / 'nope.json'}: no such results file"], proc.stderr



def test_nothing_measured_still_renders(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"runs": [
        {"label": "torch", "status": "error", "reason": "RuntimeError: boom"},
        {"label": "odd", "metrics": {"samples_per_s": "fast"}}], "tiers": [{"name": "t1"}, "junk"]}))
    page = render_report([tmp_path])
    found = sections(parse(page))
    assert set(found) == {*SECTIONS, "tiers"}
    assert "No loader setting was measured." in texts(found["ranking"])
    assert "torch : error: RuntimeError: boom" in texts(found["ranking"])  # texts() joins elements with spaces
    assert "odd : not measured: the results hold no samples/s for it" in texts(found["ranking"])
    assert "No loader setting was measured." in render_report([tmp_path], "markdown")


def test_a_failing_auto_report_only_warns(tmp_path, capsys):
    """`loadopt bench` writes the report after the results: a report that fails leaves them and warns."""
    from loadopt.cli.reading import auto_report

    results = tmp_path / "results.json"
    results.write_text('{"runs": "not a list"}')
    auto_report(results)  # no exception: the bench goes on to its summary and exit code
    err = capsys.readouterr().err
    assert "warning: the report could not be written" in err and "not a loadopt results file" in err
    assert results.read_text() == '{"runs": "not a list"}'


# --- in a real browser -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed and could not be installed here (.ci/run installs it with "
                    "apt-get where it can): the report is not rendered in a browser")
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    try:
        b.call("Browser.getVersion", timeout=30)
    except queue.Empty:
        b.proc.kill()
        pytest.fail(f"{CHROMIUM} did not answer over --remote-debugging-pipe: {b.proc.stderr.read()[-2000:]!r}")
    yield b
    b.close()


@pytest.mark.parametrize("which", ["fixture with tiers", "comparison", "real bench"])
def test_the_page_renders_in_a_browser_without_errors(browser, tmp_path, which, request):
    if which == "real bench":
        out, _ = request.getfixturevalue("real_bench")
        path = out / "report.html"
    else:
        path = write_report([TIERS] if which == "fixture with tiers" else [TIERS, AFTER], tmp_path / "r.html")
    seen = browser.open(path)
    assert seen["errors"] == []
    assert seen["outside"] == []
    not_blank(seen["png"])
    facts = seen["facts"]
    assert set(SECTIONS) <= set(facts["sections"])
    assert facts["svgs"] >= 4
    assert facts["scrollWidth"] <= 1280, "wider than a laptop screen"
    (tmp_path / "screenshot.png").write_bytes(seen["png"])


def test_the_browser_check_catches_a_broken_page(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><h1>broken</h1><img src='missing.png'>"
                    "<script>console.error('deliberate'); undefinedFunction();</script></body></html>")
    seen = browser.open(page)
    methods = sorted({e["method"] for e in seen["errors"]})
    assert methods == ["Log.entryAdded", "Runtime.consoleAPICalled", "Runtime.exceptionThrown"], seen["errors"]
    assert any(u.endswith("missing.png") for u in seen["outside"])


def test_an_unreliable_ceiling_and_a_busy_machine_are_said_and_no_fraction_above_110pct_shown(tmp_path):
    doc = json.loads((TIERS / "results.json").read_text())
    run = next(r for r in doc["runs"] if (r.get("ceiling") or {}).get("samples_per_s"))
    rate = run["metrics"]["samples_per_s"]
    rate = rate["median"] if isinstance(rate, dict) else rate
    run["ceiling"]["samples_per_s"] = rate / 6.31  # an older file: 631% of its ceiling, not marked
    doc["machine"]["load"] = {"busy": True, "note": "the machine was busy: other processes used 60% of its cores"}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    for kind in ("markdown", "html"):
        text = render_report([str(path)], kind)
        assert "631%" not in text and "unreliable" in text and "the machine was busy" in text


def test_a_steps_breakdown_on_the_emulated_device_adds_up_to_its_wall_time():
    """The copy and finishing overlap the step before there: a step is its compute and the idle time before
    it, the loader's and the host finishing's, not the host's wait, copy and finishing summed."""
    from loadopt.report.data import Run

    metrics = {"batches": 40, "wall_s": 1.6, "compute_s": 1.0, "wait_s": 1.2, "h2d_s": 0.1, "finish_s": 0.3,
               "loader_stall_fraction": {"median": 0.3, "min": 0.3, "max": 0.3}, "finish_stall_fraction": 0.075}
    step = Run("a", "delay", "ok", "", metrics, [], None).per_step_ms()
    assert step == pytest.approx({"compute": 25.0, "wait": 12.0, "h2d": 0.0, "finish": 3.0, "other": 0.0})
    serial = Run("b", "delay", "ok", "", {k: v for k, v in metrics.items() if "stall" not in k}, [], None)
    assert serial.per_step_ms() == pytest.approx({"compute": 25.0, "wait": 30.0, "h2d": 2.5, "finish": 5.0,
                                                  "other": 0.0})


def test_a_second_bench_keeps_the_first_run_and_the_report_compares_the_two(tmp_path):
    config = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": "tuned", "num_workers": 0}},
                              workload={"repeats": 1, "measure_batches": 3, "warmup_batches": 1})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    for _ in range(2):
        proc = loadopt("bench", path, "--quick", env_cache=tmp_path / "cache")
        assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    (earlier,) = (out / "runs").iterdir()  # the first run, moved aside whole as the second began to write
    assert sorted(p.name for p in earlier.iterdir()) == ["decision.json", "report.html", "results.json",
                                                         "timings.parquet"]
    first, second = (json.loads((where / "results.json").read_text()) for where in (earlier, out))
    assert first["created"] < second["created"] and re.sub(r"[^0-9T]", "", first["created"])[:15] == earlier.name
    proc = loadopt("report", earlier / "results.json", out / "results.json", "--format", "markdown")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("torch") >= 2  # both runs, side by side


def test_log_to_tensorboard_records_the_table_the_ceilings_and_the_timeline(real_bench, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'loadopt[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from loadopt.report.trackers import log_results

    out, _ = real_bench
    where = Path(log_results(out / "results.json", f"tensorboard:{tmp_path / 'tb'}"))
    events = EventAccumulator(str(where))
    events.Reload()
    tags = events.Tags()["scalars"]
    results = json.loads((out / "results.json").read_text())
    for run in results["runs"]:
        if run["status"] == "ok":
            (value,) = events.Scalars(f"table/samples_per_s/{run['label']}")
            assert value.value == pytest.approx(run["metrics"]["samples_per_s"]["median"], rel=1e-6)
            timeline = events.Scalars(f"timeline/{run['label']}/wait_ms")
            assert len(timeline) == sum(1 for r in pq_rows(out) if r["label"] == run["label"] and r["measured"])
    assert any(tag.startswith("ceilings/") for tag in tags)
    assert "table/text_summary" in events.Tags()["tensors"]  # the Markdown table, as text


def pq_rows(out):
    import pyarrow.parquet as pq

    return pq.read_table(out / "timings.parquet").to_pylist()


def test_log_to_an_unknown_tracker_is_one_line_before_any_work(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "out")))
    proc = loadopt("bench", path, "--log-to", "tensorbored:x", env_cache=tmp_path / "cache")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --log-to tensorbored:x: unknown tracker 'tensorbored' (known: tensorboard, wandb, mlflow; e.g. "
        "tensorboard:runs/loadopt)")
    assert not (tmp_path / "cache").exists()  # refused before the dataset was made


def test_a_bench_with_no_step_takes_batches_as_they_come_and_says_so(tmp_path):
    """`workload.step_time_ms: 0`: the rate is the input path's alone; no stall or utilisation is shown as a figure."""
    config = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": "tuned", "num_workers": 1}},
                              workload={"step_time_ms": 0, "repeats": 1, "measure_batches": 3, "warmup_batches": 1})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = loadopt("bench", path, env_cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout + proc.stderr  # the progress lines go to stderr off a terminal
    assert "samples/s, no step" in said and "stall 100%" not in said
    row = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("1 "))
    assert " - " in row and "100.0%" not in row  # the stall, loader and finish columns
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["runs"][0]["metrics"]["compute_s"]["median"] == 0  # the file keeps every raw figure
    explained = loadopt("explain", tmp_path / "out")
    assert "batches taken as fast as they came (no step)" in explained.stdout, explained.stdout + explained.stderr
    assert "idle" not in explained.stdout
    markdown = loadopt("report", tmp_path / "out" / "results.json", "--format", "markdown")
    assert "no step: batches taken as fast as they come" in markdown.stdout
    assert "100.0%" not in markdown.stdout


def test_log_to_mlflow_records_the_table_the_ceilings_the_timeline_and_the_files(real_bench, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'loadopt[mlflow]')")
    from mlflow.tracking import MlflowClient

    # a folder store: no server here (MLflow 3 asks for this to accept one; a database store needs SQLAlchemy)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    from loadopt.report.trackers import _mlflow_key, log_results

    out, _ = real_bench
    uri = (tmp_path / "mlruns").as_uri()
    said = log_results(out / "results.json", f"mlflow:{uri}")
    run_id = said.rsplit(" ", 1)[-1]
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    results = json.loads((out / "results.json").read_text())
    for setting in results["runs"]:
        if setting["status"] == "ok":
            key = _mlflow_key(f"samples_per_s/{setting['label']}")
            assert run.data.metrics[key] == pytest.approx(setting["metrics"]["samples_per_s"]["median"], rel=1e-6)
            timeline = client.get_metric_history(run_id, _mlflow_key(f"timeline/{setting['label']}/wait_ms"))
            assert len(timeline) == sum(1 for r in pq_rows(out) if r["label"] == setting["label"] and r["measured"])
    assert any(key.startswith("ceilings/") for key in run.data.metrics)
    assert {a.path for a in client.list_artifacts(run_id)} >= {"results.json", "results.md"}


def test_log_to_wandb_offline_records_the_table_the_ceilings_the_timeline_and_the_results(real_bench, tmp_path,
                                                                                         monkeypatch):
    """The real W&B library, offline (no account, no network: the run is written where `wandb sync` reads it); what
    reached its `log` is read back from the calls, its own run files for the results.json it keeps."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install 'loadopt[wandb]')")
    from loadopt.report.trackers import log_results

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[dict] = []
    real_log = wandb.sdk.wandb_run.Run.log
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log",
                        lambda self, data, *a, **k: (logged.append(dict(data)), real_log(self, data, *a, **k))[1])
    out, _ = real_bench
    files = Path(log_results(out / "results.json", "wandb:loadopt-test"))
    assert files.is_dir() and str(files).startswith(str(tmp_path)) and list(files.parent.glob("run-*.wandb"))
    results = json.loads((out / "results.json").read_text())
    assert json.loads((files / "results.json").read_text()) == results
    measured = [r for r in results["runs"] if r["status"] == "ok"]
    table = logged[0]["table"]
    assert isinstance(table, wandb.Table) and [row[0] for row in table.data] == [r["label"] for r in measured]
    assert any(key.startswith("ceilings/") for key in logged[0])
    for run in measured:
        steps = [entry for entry in logged if f"timeline/{run['label']}/wait_ms" in entry]
        assert len(steps) == sum(1 for r in pq_rows(out) if r["label"] == run["label"] and r["measured"])
