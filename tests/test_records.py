"""Record workloads (`dataset.kind: records`, storage/sources/records.py) and `loadopt import-dlio`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from loadopt import make_loader
from loadopt.bench.runner import run_bench
from loadopt.cli import app
from loadopt.config import config_from_dict, load_config
from loadopt.errors import DatasetError
from loadopt.procurement.dlio import config_from_dlio
from loadopt.storage.open import open_dataset
from loadopt.storage.sources.records import open_records, record_sizes


def records_config(tmp_path, file_format="npz", **records) -> dict:
    spec = {"record_bytes": 40_000, "record_bytes_stdev": 10_000, "samples_per_file": 3, "num_files": 5,
            "file_format": file_format, "delivered_bytes": 30_000, **records}
    return {"name": "rec", "dataset": {"kind": "records", "records": spec}, "pipeline": {"batch_size": 4},
            "workload": {"step_time_ms": 1, "warmup_batches": 1, "measure_batches": 4, "repeats": 1},
            "loaders": {"torch": {"num_workers": 0}}, "report": {"out": str(tmp_path / "out")}}


@pytest.mark.parametrize("file_format", ["npz", "raw"])
def test_synthetic_records_have_the_stated_sizes_and_read_back(tmp_path, file_format):
    config = config_from_dict(records_config(tmp_path, file_format), "rec.yaml")
    dataset = open_dataset(config)
    spec = config.dataset.records
    assert dataset.kind == "records" and len(dataset) == 15 and len(dataset.files) == 5
    per_file = record_sizes(spec)
    assert np.array_equal(dataset.sizes, np.repeat(per_file, 3))
    assert len(set(per_file.tolist())) > 1  # sizes spread per file (stdev 10,000)
    record, read = dataset.read_record(4)  # file 1, row 1
    assert len(record) == dataset.sizes[4]
    if file_format == "npz":  # the file is read whole for one record (as DLIO's npz reader does)
        assert read == Path(dataset.files[1].decode()).stat().st_size > 3 * dataset.sizes[4]
    else:  # the record's own byte range
        assert read == dataset.sizes[4]
    again = open_records(dataset.root, spec)
    assert again.fingerprint == dataset.fingerprint
    out = np.ones(30_000, dtype=np.uint8)
    dataset.deliver(record[:1000], out)
    assert np.array_equal(out[:1000], record[:1000]) and not out[1000:].any()
    # read_into: the same record delivered into a row (first bytes, zero-padded), the same bytes counted
    for width in (30_000, int(dataset.sizes[4]) + 7):
        row = np.ones(width, dtype=np.uint8)
        assert dataset.read_into(4, row) == read
        kept = min(width, len(record))
        assert np.array_equal(row[:kept], record[:kept]) and not row[kept:].any()


def test_accelerator_step_scales_with_the_records():
    raw = {"dataset": {"kind": "records", "records": {"scale": 0.1}}, "pipeline": {"batch_size": 7},
           "workload": {"accelerator": "h100-unet3d"}}
    assert config_from_dict(raw, "x.yaml").workload.step_time_ms == pytest.approx(323 * 0.1)
    for name in ("unet3d", "resnet50_storage", "cosmoflow"):
        assert load_config(f"configs/{name}.yaml", []).dataset.kind == "records"


def test_a_bench_of_records_runs_the_backends_that_read_them(tmp_path):
    raw = records_config(tmp_path)
    raw["loaders"] = {"torch": {"num_workers": [0, 1]}, "arrow": {}}
    outcome = run_bench(config_from_dict(raw, "rec.yaml"))
    runs = list(outcome.document()["runs"])
    assert [r["status"] for r in runs] == ["ok"] * 3 and all(r["recipe"]["kind"] == "records" for r in runs)
    assert all(r["metrics"]["samples_per_s"]["median"] > 0 for r in runs)
    # torch reads an npz file whole per record: more bytes read than delivered
    assert all(r["metrics"]["goodput_ratio"]["median"] < 0.5 for r in runs if r["backend"] == "torch")
    arrow = next(r for r in runs if r["backend"] == "arrow")
    assert arrow["label"].startswith("arrow records")  # read from the Arrow file's records form
    assert json.loads(outcome.json_path.read_text())["runs"][0]["status"] == "ok"


def test_make_loader_delivers_fixed_size_records(tmp_path):
    loader = make_loader(records_config(tmp_path, "raw"), backend="torch")
    batches = list(loader)
    assert len(batches) == 4  # 15 records, batch 4, last one short
    inputs, labels = batches[0]
    assert inputs.dtype.is_floating_point is False and tuple(inputs.shape) == (4, 30_000)
    assert labels.tolist() == [0, 0, 0, 0]


def test_a_damaged_record_file_is_named(tmp_path):
    config = config_from_dict(records_config(tmp_path), "rec.yaml")
    dataset = open_dataset(config)
    folder = tmp_path / "copy"
    folder.mkdir()
    for name in dataset.files:
        path = name.decode()
        (folder / Path(path).name).write_bytes(Path(path).read_bytes())
    victim = sorted(folder.iterdir())[2]
    victim.write_bytes(victim.read_bytes()[:100])  # cut short: no zip directory
    with pytest.raises(DatasetError, match=victim.name):
        open_records(str(folder), config.dataset.records)


UNET3D = """
model: {name: unet3d}
framework: pytorch
workflow: {generate_data: False, train: True, checkpoint: True}
dataset: {data_folder: data/unet3d/, format: npz, num_files_train: 168, num_samples_per_file: 1,
          record_length_bytes: 146600628, record_length_bytes_stdev: 68341808, record_length_bytes_resize: 2097152}
reader: {data_loader: pytorch, batch_size: 7, read_threads: 4, file_shuffle: seed, sample_shuffle: seed}
train: {epochs: 5, computation_time: 0.323}
checkpoint: {checkpoint_folder: checkpoints/unet3d, model_size: 499153191}
metric: {au: 0.90}
"""


def test_import_dlio_maps_the_workload_and_names_the_rest(tmp_path):
    config, notes = config_from_dlio(yaml.safe_load(UNET3D), "unet3d.yaml")
    assert config["dataset"]["records"] == {"record_bytes": 146600628, "record_bytes_stdev": 68341808,
                                            "samples_per_file": 1, "num_files": 168, "file_format": "npz",
                                            "delivered_bytes": 2097152}
    assert config["pipeline"]["batch_size"] == 7 and config["workload"]["step_time_ms"] == 323.0
    assert config["loaders"]["torch"] == {"num_workers": 4, "variant": "plain", "persistent_workers": True,
                                          "prefetch_factor": 1}  # DLIO's: ceil(prefetch_size 2 / 4 threads)
    assert any(n.startswith("checkpoint.model_size") for n in notes)
    assert any("loadopt tiers --au 0.9" in n for n in notes)
    path = tmp_path / "unet3d.yaml"
    path.write_text(UNET3D)
    result = CliRunner().invoke(app, ["import-dlio", str(path)])
    assert result.exit_code == 0
    written = tmp_path / "config.yaml"
    written.write_text(result.stdout)
    assert load_config(str(written), []).dataset.records.num_files == 168
    assert "# no equivalent" in result.stdout


@pytest.mark.parametrize("text, message", [
    ("dataset: [1, 2]", "not a DLIO workload file"),
    ("dataset: {format: npz}", "record_length_bytes: missing"),
    ("dataset: {record_length: many}", "expected a number"),
    ("dataset: {record_length: 10\n", "invalid YAML"),
])
def test_import_dlio_bad_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["import-dlio", str(path)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_tiers_count_the_accelerators_a_tier_keeps_on_records(tmp_path):
    from loadopt.procurement.plan import demand
    from loadopt.procurement.run import run_tiers

    raw = records_config(tmp_path, "raw", record_bytes=8_000, record_bytes_stdev=0, samples_per_file=8,
                         num_files=8, delivered_bytes=4_000)
    raw["workload"]["step_time_ms"] = 20
    config = config_from_dict(raw, "rec.yaml")
    need = demand(config, 8_000.0, 0.9)["mb_per_s_at_threshold"]
    # A tier of 2.5 accelerators' bandwidth keeps 2 at AU >= 0.9; an unbounded one is limited by the
    # dataset: 64 records give at most 16 accelerators a batch of 4.
    tiers = [{"name": "bw2", "bandwidth_mb_s": 2.5 * need, "latency_ms": 1.0}, {"name": "fast", "latency_ms": 0.1}]
    result = run_tiers(config, tiers, au=0.9, max_accelerators=64, warmup_s=0.3, measure_s=0.8, probe_s=0.5,
                       budget_s=60).document()
    limited, fast = result["tiers"]
    assert abs(limited["accelerators_supported"] - 2) <= 1, limited["trials"]
    assert limited["capacity_tb"] == pytest.approx(64 * 8_000 / 1e12)
    if fast["accelerators_supported"] == 16:  # (fewer where this machine's 2 cores run out first)
        assert "bounded by the dataset: 64 samples give at most 16 accelerators" in fast["measured_note"]
    assert max(t["accelerators"] for t in fast["trials"]) <= 16


def test_records_in_dlio_npz_layout_are_read(tmp_path):
    folder = tmp_path / "dlio"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for k in range(2):  # as DLIO's NPZGenerator writes them: x (dim1, dim2, samples), y labels
        np.savez(folder / f"img_{k + 1}_of_2.npz", x=rng.integers(0, 255, size=(30, 40, 3), dtype=np.uint8),
                 y=[0, 0, 0])
    config = config_from_dict({"dataset": {"kind": "records", "path": str(folder), "records": {
        "samples_per_file": 3, "file_format": "npz", "delivered_bytes": 1000}}}, "dlio.yaml")
    dataset = open_dataset(config)
    assert len(dataset) == 6 and set(dataset.sizes.tolist()) == {1200}
    record, _ = dataset.read_record(4)  # file 1, sample 1
    with np.load(folder / "img_2_of_2.npz") as archive:
        assert np.array_equal(record, archive["x"][..., 1].reshape(-1))


@pytest.mark.parametrize(("name", "files", "scaled_files", "scale"), [("unet3d", 168, 168, 0.02),
                                                                     ("resnet50_storage", 1024, 16, 1.0),
                                                                     ("cosmoflow", 524288, 2048, 0.1)])
def test_the_published_sizes_are_behind_one_key(name, files, scaled_files, scale):
    scaled = load_config(f"configs/{name}.yaml", [])
    published = load_config(f"configs/{name}.yaml", ["dataset.records.scale=published"])
    assert (scaled.dataset.records.num_files, scaled.dataset.records.scale) == (scaled_files, scale)
    assert (published.dataset.records.num_files, published.dataset.records.scale) == (files, 1.0)
    assert published.workload.step_time_ms == pytest.approx(scaled.workload.step_time_ms / scale)
    assert published.dataset.records.record_bytes == scaled.dataset.records.record_bytes  # scale applies to it
