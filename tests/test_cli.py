"""The `loadopt` command end to end, as a user runs it (subprocesses)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from .conftest import make_image_folder, tiny_config_dict


def loadopt(*args, env_cache=None, timeout=300):
    env = dict(os.environ)
    if env_cache:
        env["LOADOPT_CACHE"] = str(env_cache)
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "loadopt.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_line_error(proc, code=None):
    assert proc.returncode != 0, proc.stdout + proc.stderr
    if code is not None:
        assert proc.returncode == code
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr  # progress lines may come before it
    assert "Traceback" not in proc.stderr
    return errors[0]


def test_bench_end_to_end(tiny_config, tmp_path):
    out = tmp_path / "out"
    proc = loadopt("bench", tiny_config, "--out", out)
    assert proc.returncode == 0, proc.stderr
    for label in ("torch plain w=0", "torch tuned w=1"):  # the table's short labels: the knob the sweep varies
        assert label in proc.stdout
    assert "fastest: torch " in proc.stdout
    results = json.loads((out / "results.json").read_text())
    labels = {run["label"] for run in results["runs"]}  # the full labels: in the results
    assert {"torch plain num_workers=0", "torch tuned num_workers=1 prefetch=2"} <= labels
    assert results["schema_version"] == 2
    assert results["machine"]["cpu_count"] >= 1 and "torch" in results["machine"]["libraries"]
    assert results["dataset"]["num_samples"] == 48 and results["dataset"]["fingerprint"]
    assert len(results["ranking"]) == 4
    run = results["runs"][0]
    for key in ("samples_per_s", "mb_per_s", "accelerator_utilisation", "stall_fraction", "wait_p99_ms",
                "h2d_gb_per_s", "goodput_ratio", "cpu_seconds_per_1k_samples", "peak_rss_mb"):
        assert key in run["metrics"], key
    timings = pq.read_table(out / "timings.parquet")
    assert timings.num_rows == 4 * 7  # 4 settings x (1 warm-up + 6 measured) batches
    assert set(timings.column_names) >= {"wait_s", "h2d_s", "compute_s", "measured"}


def test_bench_quick_with_loaders_and_set(tiny_config, tmp_path):
    proc = loadopt("bench", tiny_config, "--quick", "--loaders", "torch", "--set", "loaders.torch.variant=tuned",
                   "--set", "loaders.torch.num_workers=0", "--out", tmp_path / "q")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "q" / "results.json").read_text())
    assert results["quick"] and results["ranking"] == ["torch tuned num_workers=0"]


def test_make_dataset_then_reuse(tiny_config):
    first = loadopt("make-dataset", tiny_config)
    assert first.returncode == 0, first.stderr
    assert "48 images in 4 classes" in first.stdout
    second = loadopt("make-dataset", tiny_config)
    assert second.returncode == 0 and "generating" not in second.stderr


def test_doctor_reports_without_a_gpu():
    proc = loadopt("doctor")
    assert proc.returncode == 0, proc.stderr
    for item in ("torch", "CUDA", "nvidia-dali-cuda120", "kvikio", "/dev/shm", "CPU cores", "RAM",
                 "backend torch", "backend arrow"):
        assert item in proc.stdout
    if "No module named 'nvidia'" in proc.stdout:
        assert "pip install 'loadopt[dali]'" in proc.stdout  # brackets survive rich markup


def test_doctor_says_how_to_add_the_peers_keeping_torch_and_whether_torchvision_fits(tmp_path, monkeypatch):
    import numpy
    import torch

    from loadopt.doctor import peers_checks, peers_constraints

    assert peers_constraints() == f"torch=={torch.__version__}\nnumpy=={numpy.__version__}\n"
    (advice,) = [c for c in peers_checks() if c.item == "peers install"]
    assert "loadopt doctor --constraints > keep.txt" in advice.detail and "-c keep.txt" in advice.detail
    info = tmp_path / "torchvision-9.9.dist-info"  # a torchvision on the path, made for another torch
    info.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    release = torch.__version__.split("+", 1)[0]
    for wants, fits in (("99.0", False), (release, True)):
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 9.9\nRequires-Dist: numpy\n"
                                       f"Requires-Dist: torch (=={wants})\nRequires-Dist: scipy ; extra == 'scipy'\n")
        (check,) = [c for c in peers_checks() if c.item == "torchvision"]
        assert check.ok is fits, check.detail
        assert check.detail.startswith("9.9 wants torch==99.0" if not fits else f"9.9, fits torch {torch.__version__}")


@pytest.mark.parametrize(("content", "expected"), [
    ({"workload": {"step_time_ms": "fast"}}, "workload.step_time_ms: expected a number, got 'fast'"),
    ({"pipeline": {"nonsense": 1}}, "pipeline.nonsense: unknown key"),
])
def test_bad_config(tmp_path, content, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(content))
    assert one_line_error(loadopt("bench", path), code=2) == f"error: {path}: {expected}"


def test_missing_config_file(tmp_path):
    line = one_line_error(loadopt("bench", tmp_path / "nope.yaml"), code=2)
    assert line == f"error: {tmp_path / 'nope.yaml'}: config file not found"


def test_bad_override(tiny_config):
    line = one_line_error(loadopt("bench", tiny_config, "--set", "workload.step_time_ms=fast"), code=2)
    assert "(--set workload.step_time_ms=fast): workload.step_time_ms: expected a number" in line


def config_for_folder(tmp_path, folder, **dataset):
    path = tmp_path / "real.yaml"
    data = tiny_config_dict(tmp_path / "results", dataset={"path": str(folder), **dataset},
                            loaders={"torch": {"variant": "tuned", "num_workers": 1}})
    path.write_text(yaml.safe_dump(data))
    return path


def test_empty_dataset_folder(tmp_path):
    (tmp_path / "data" / "train").mkdir(parents=True)
    line = one_line_error(loadopt("bench", config_for_folder(tmp_path, tmp_path / "data")))
    assert str(tmp_path / "data" / "train") in line and "no images found" in line


def test_missing_dataset_folder(tmp_path):
    line = one_line_error(loadopt("bench", config_for_folder(tmp_path, tmp_path / "absent")))
    assert f"{tmp_path / 'absent'}: dataset folder not found" in line


def test_corrupt_jpeg_raise_and_skip(tmp_path):
    bad = make_image_folder(tmp_path / "data", classes=2, per_class=30, corrupt=1)[0]
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "data").rglob("*")}
    line = one_line_error(loadopt("bench", config_for_folder(tmp_path, tmp_path / "data")))
    assert str(bad) in line and "on_error: skip" in line
    proc = loadopt("bench", config_for_folder(tmp_path, tmp_path / "data", on_error="skip"))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    skipped = results["runs"][0]["skipped_files"]
    assert skipped and {s["path"] for s in skipped} == {str(bad)}
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "data").rglob("*")} == before  # never written to


def test_unwritable_output_folder(tiny_config, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_line_error(loadopt("bench", tiny_config, "--out", blocker / "sub"))
    assert f"{blocker / 'sub'}: cannot write the output folder" in line


def test_unknown_loader_name(tiny_config):
    line = one_line_error(loadopt("bench", tiny_config, "--loaders", "nonesuch"), code=2)
    assert "--loaders nonesuch: unknown backend 'nonesuch'" in line


def test_previous_results_survive_a_failed_run(tiny_config, tmp_path):
    out = tmp_path / "keep"
    assert loadopt("bench", tiny_config, "--quick", "--out", out).returncode == 0
    good = (out / "results.json").read_text()
    assert loadopt("bench", tiny_config, "--out", out, "--set", "pipeline.batch_size=0").returncode == 2
    assert (out / "results.json").read_text() == good
    assert not [p for p in Path(out).iterdir() if p.name.endswith(".tmp")]


def test_cuda_requested_without_a_gpu(tiny_config):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = one_line_error(loadopt("bench", tiny_config, "--set", "workload.device=cuda"))
    assert "device cuda: CUDA is not available on this machine" in line


def test_bench_with_no_measurable_backend_fails(tiny_config, tmp_path):
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("kvikio may run here: this machine has the CUDA driver")
    except OSError:
        pass
    proc = loadopt("bench", tiny_config, "--quick", "--loaders", "kvikio", "--out", tmp_path / "none")
    line = one_line_error(proc, code=1)
    assert "no loader setting could be measured (kvikio: libcuda.so.1 not found" in line


@pytest.mark.parametrize("module", ["loadopt.cli", "loadopt"])
def test_the_command_line_imports_no_torch(module):
    """`loadopt --help` must stay light: torch, the loaders and the harness load only when a command runs."""
    probe = (f"import sys, {module}; heavy = sorted(m for m in ('torch', 'numpy', 'pyarrow', 'loadopt.loaders', "
             "'loadopt.bench') if m in sys.modules); print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_help_lists_every_command_without_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "loadopt", "--help"], capture_output=True,
                         text=True, check=True)
    for command in ("bench", "measure", "report", "doctor", "explain", "probe", "tiers", "make-dataset", "convert"):
        assert command in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "loadopt.bench.runner" not in imported


def test_the_bench_table_fits_120_columns_one_line_a_setting():
    """The main job's table reads at a glance: every setting on one line within 120 columns, named by a
    short label that tells the sweep's settings apart (the full label stays in results.json)."""
    from rich.console import Console

    from loadopt.cli.tables import results_table, verdict_lines
    from loadopt.schema.documents import read_results_file

    results = read_results_file(Path(__file__).parent / "fixtures" / "bench_after" / "results.json")
    console = Console(width=120, record=True)
    console.print(results_table(results))
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    assert max(len(line) for line in lines) <= 120
    rows = [line for line in lines if line[:3].strip().isdigit()]
    assert len(rows) == len(results.ranking)
    labels = [row.split("  ")[1].strip() if "  " in row else row for row in rows]
    assert len(set(labels)) == len(labels) and all("…" not in label for label in labels)
    for line in verdict_lines(results):
        assert len(line) <= 160 and "\n" not in line
