"""Every backend reads through the configured tier: its counters see every byte of every backend (no
backend bypasses it by memory-mapping or preading its converted files), a failing tier fails them
all, plain local disk keeps the direct paths, and conversions of a dataset on other storage live and
are read there."""

from __future__ import annotations

import json

import fsspec
import pytest
import torch

from loadopt.bench.runner import run_bench
from loadopt.config import config_from_dict
from loadopt.errors import DatasetError, StorageError
from loadopt.schema.documents import ResultsFile
from loadopt.storage.open import open_dataset
from loadopt.storage.tiers.stack import tier_counters

from .conftest import epoch_inputs, make_image_folder, prepared_loader, tiny_config_dict
from .test_kvikio import cpu_jpeg_decoder

FAST_TIER = {"name": "fast", "bandwidth_mb_s": 2000}
# (backend, settings): every built-in path that runs on a CPU-only machine
SETTINGS = [("torch", {"variant": "plain", "num_workers": 1}), ("torch", {"variant": "tuned", "num_workers": 0}),
            ("dali", {"num_threads": 1}), ("dali", {"num_threads": 1, "source": "arrow"}),
            ("arrow", {"form": "decoded"}), ("arrow", {"form": "encoded"}),
            ("posix", {"form": "decoded", "shard_mib": 0.25}), ("posix", {"form": "encoded", "shard_mib": 0.25})]


def _config(tmp_path, tier, **sections):
    sections["storage"] = {"tier": tier, **sections.get("storage", {})}
    raw = tiny_config_dict(tmp_path / "results", **sections)
    return config_from_dict(raw, "tier.yaml")


@pytest.mark.parametrize(("backend", "settings"), SETTINGS, ids=[f"{b}-{'-'.join(map(str, s.values()))}"
                                                                 for b, s in SETTINGS])
def test_every_backend_reads_through_the_tier(tmp_path, backend, settings):
    config = _config(tmp_path, FAST_TIER)
    dataset = open_dataset(config)
    loader = prepared_loader(config, dataset, backend, settings)
    before = tier_counters(dataset.fs)
    tiered = epoch_inputs(loader)
    after = tier_counters(dataset.fs)
    read = loader.counters.bytes_read
    assert read > 0 and after["bytes"] - before["bytes"] >= 0.95 * read, (after["bytes"] - before["bytes"], read)
    assert after["requests"] > before["requests"]
    # the tier changes nothing but speed: the same batches as straight from the local disk
    local_config = _config(tmp_path, "local")
    local = epoch_inputs(prepared_loader(local_config, open_dataset(local_config), backend, settings))
    assert len(local) == len(tiered) and all(torch.equal(a, b) for a, b in zip(local, tiered, strict=True))


def test_kvikio_reads_through_the_tier_into_host_memory(tmp_path):
    from loadopt.loaders.kvikio.loader import KvikioLoader
    from loadopt.loaders.posix.loader import PosixSettings
    from loadopt.storage.forms.tier_reads import TierReader

    config = _config(tmp_path, FAST_TIER)
    dataset = open_dataset(config)
    loader = KvikioLoader(dataset, config.pipeline, PosixSettings(form="encoded", shard_mib=0.25), seed=3)
    # the CPU stands in for the device and its JPEG decoder: the reads are the tier's either way
    loader.staging_device, loader.jpeg_decoder = "cpu", cpu_jpeg_decoder
    loader.prepare()
    assert isinstance(loader._reader, TierReader) and "via tier" in loader.describe()
    before = tier_counters(dataset.fs)["bytes"]
    batches = epoch_inputs(loader)
    assert len(batches) == 6 and tier_counters(dataset.fs)["bytes"] - before >= 0.95 * loader.counters.bytes_read > 0


def test_plain_local_disk_keeps_the_direct_paths(tmp_path):
    from loadopt.loaders.shard_reader import PosixReader

    config = _config(tmp_path, "local")
    dataset = open_dataset(config)
    assert tier_counters(dataset.fs) is None
    posix = prepared_loader(config, dataset, "posix", {"shard_mib": 0.25})
    arrow = prepared_loader(config, dataset, "arrow", {})
    assert isinstance(posix._reader, PosixReader) and arrow._shadow is None
    assert "via tier" not in posix.describe() + arrow.describe()
    posix.close()
    arrow.close()


def test_a_failing_tier_fails_every_backend(tmp_path):
    tier = {"name": "broken", "error_rate": 1.0, "retry": {"max_attempts": 2, "base_delay_s": 0.001}}
    config = _config(tmp_path, "local")  # convert first, through no tier
    for backend, settings in SETTINGS[4:]:
        prepared_loader(config, open_dataset(config), backend, settings).close()
    config = _config(tmp_path, tier)
    dataset = open_dataset(config)
    for backend, settings in SETTINGS[4:]:
        with pytest.raises(StorageError, match="read failed 2 times"):
            epoch_inputs(prepared_loader(config, dataset, backend, settings))


def test_bench_records_tier_bytes_and_where_the_bytes_came_from(tmp_path):
    loaders = {"arrow": {"form": "encoded"}, "posix": {"form": "decoded", "shard_mib": 0.25},
               "torch": {"variant": "tuned", "num_workers": 0}}
    raw = tiny_config_dict(tmp_path / "out", storage={"tier": FAST_TIER, "cache": "cold"}, loaders=loaders,
                           workload={"step_time_ms": 0, "warmup_batches": 6, "measure_batches": 12, "repeats": 1})
    # warm-up and window are whole epochs (6 batches): no read ahead of the window's edges in either count
    run_bench(config_from_dict(raw, "tier.yaml"), attribute=False)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["status"] for r in results["runs"]] == ["ok"] * 3
    for run in results["runs"]:
        metrics = run["metrics"]
        tier_bytes, read = metrics["tier_bytes"]["median"], metrics["bytes_read"]["median"]
        assert tier_bytes >= 0.95 * read > 0, (run["label"], tier_bytes, read)
        assert run["bytes_source"].startswith("tier fast"), run["bytes_source"]
    raw = tiny_config_dict(tmp_path / "local", loaders={"arrow": {"form": "encoded"}},
                           workload={"step_time_ms": 0, "warmup_batches": 1, "measure_batches": 2, "repeats": 1})
    run_bench(config_from_dict(raw, "local.yaml"), attribute=False)
    (run,) = json.loads((tmp_path / "local" / "results.json").read_text())["runs"]
    assert run["metrics"]["tier_bytes"] is None and run["bytes_source"].startswith("local disk")
    # the report says where each file's bytes came from
    from loadopt.report import write_report

    page = write_report([tmp_path / "out" / "results.json"]).read_text()
    assert "Bytes from: tier fast (emulated) over local disk" in page
    markdown = write_report([tmp_path / "local" / "results.json"], tmp_path / "r.md", fmt="markdown").read_text()
    assert "**Bytes from:** local disk (direct reads)" in markdown


def _memory_dataset_root(tmp_path) -> str:
    """A small ImageFolder copied into fsspec's in-memory filesystem: storage that is not the local disk."""
    make_image_folder(tmp_path / "src", classes=2, per_class=8)
    fs = fsspec.filesystem("memory")
    root = f"/tiertest-{tmp_path.name}"
    for path in sorted((tmp_path / "src").rglob("*.jpg")):
        fs.pipe_file(f"{root}/{path.relative_to(tmp_path / 'src').as_posix()}", path.read_bytes())
    return root


@pytest.mark.parametrize("backend", ["arrow", "posix"])
def test_conversions_of_a_remote_dataset_live_and_are_read_on_its_storage(tmp_path, backend):
    root = _memory_dataset_root(tmp_path)
    config = _config(tmp_path, {"name": "remote", "base": f"memory://{root}"},
                     pipeline={"batch_size": 4, "image_size": 24})
    dataset = open_dataset(config)
    assert dataset.converted == f"memory://{root}/train/.loadopt"
    loader = prepared_loader(config, dataset, backend,
                             {"form": "encoded"} if backend == "arrow" else {"shard_mib": 0.25})
    fs = fsspec.filesystem("memory")
    stored = fs.find(f"{root}/train/.loadopt")
    names = {path.rsplit("/", 1)[-1] for path in stored}
    # the manifest (written last) and the shards
    assert "manifest.json" in names and all(n.startswith("shard-") for n in names - {"manifest.json"}), names
    assert any(n.endswith(".arrow" if backend == "arrow" else ".bin") for n in names), names
    assert loader.storage_files() == []  # nothing local to evict: the bytes come from that storage
    before = tier_counters(dataset.fs)["bytes"]
    batches = epoch_inputs(loader)
    assert len(batches) == 4 and tier_counters(dataset.fs)["bytes"] - before >= 0.95 * loader.counters.bytes_read
    # the reads are of the copy on that storage: remove it under an opened loader and they fail
    loader = prepared_loader(config, dataset, backend,
                             {"form": "encoded"} if backend == "arrow" else {"shard_mib": 0.25})
    fs.rm(f"{root}/train/.loadopt", recursive=True)
    with pytest.raises((FileNotFoundError, DatasetError, StorageError)):
        epoch_inputs(loader)


def test_storage_converted_names_another_place_and_a_read_only_one_is_one_line(tmp_path):
    root = _memory_dataset_root(tmp_path)
    tier = {"name": "remote", "base": f"memory://{root}"}
    config = _config(tmp_path, tier, pipeline={"batch_size": 4, "image_size": 24},
                     storage={"converted": f"memory://{root}-conversions"})
    dataset = open_dataset(config)
    epoch_inputs(prepared_loader(config, dataset, "arrow", {"form": "encoded"}))
    assert fsspec.filesystem("memory").find(f"{root}-conversions")
    # a base on the local disk (an NFS mount): conversions go beside the source; a read-only one names the key
    make_image_folder(tmp_path / "nfs", classes=2, per_class=3)
    blocker = tmp_path / "nfs" / "train" / ".loadopt"
    blocker.write_text("a file where the conversions' folder would go")
    config = _config(tmp_path, {"name": "nfs", "base": str(tmp_path / "nfs")}, pipeline={"batch_size": 4,
                                                                                         "image_size": 24})
    dataset = open_dataset(config)
    assert dataset.converted == str(blocker)
    with pytest.raises(DatasetError, match="storage.converted") as info:
        prepared_loader(config, dataset, "arrow", {"form": "encoded"})
    assert "\n" not in str(info.value)


def test_the_bench_table_names_each_rows_bytes_source_and_puts_reasons_under_it():
    from rich.console import Console

    from loadopt.cli.tables import bytes_source_lines, not_run_lines, results_table

    reason = "nvidia-dali not usable (ModuleNotFoundError: No module named 'nvidia'); pip install 'loadopt[dali]'"
    metrics = {"samples_per_s": {"median": 100.0, "min": 90.0, "max": 110.0}, "mb_per_s": 11.0,
               "stall_fraction": 0.5, "wait_p99_ms": 3.0, "cpu_seconds_per_1k_samples": 1.0, "peak_pss_mb": 100.0}
    results = ResultsFile.model_validate(
        {"config": {"name": "t"}, "device": "cpu", "dataset": {"num_samples": 8}, "ranking": ["torch plain"],
         "runs": [{"label": "torch plain", "metrics": metrics, "bytes_source": "tier fast (emulated) over local disk"},
                  {"label": "dali", "status": "unavailable", "reason": reason}]})
    console = Console(width=200, record=True)
    console.print(results_table(results))
    table = console.export_text()
    # one source for every row: said once under the table, not a column (it is one when the rows differ)
    assert "unavailable" in table and "ModuleNotFoundError" not in table and "bytes from" not in table
    assert not_run_lines(results) == [f"dali: unavailable: {reason}"]
    assert bytes_source_lines(results)[0].startswith("bytes from tier fast (emulated) over local disk")


@pytest.mark.parametrize("backend", ["arrow", "posix"])
def test_storage_that_refuses_the_upload_keeps_the_conversion_in_the_local_cache(tmp_path, own_cache, monkeypatch,
                                                                              backend):
    """A bucket that refuses writes (a read-only one): the default home beside the source gives way to the
    local cache, read from the local disk directly, and the setting says so; the same refusal of an explicit
    `storage.converted` is the one-line error naming it."""
    root = _memory_dataset_root(tmp_path)

    def refused(self, lpath, rpath, **kwargs):
        raise PermissionError(13, "Access Denied", rpath)

    monkeypatch.setattr(fsspec.implementations.memory.MemoryFileSystem, "put_file", refused)
    settings = {"form": "encoded"} if backend == "arrow" else {"shard_mib": 0.25}
    config = _config(tmp_path, {"name": "remote", "base": f"memory://{root}"}, pipeline={"batch_size": 4,
                                                                                        "image_size": 24})
    dataset = open_dataset(config)
    loader = prepared_loader(config, dataset, backend, settings)
    assert dataset.converted is None and not fsspec.filesystem("memory").find(f"{root}/train/.loadopt")
    assert loader.bytes_source().startswith("local disk (direct reads of the conversion in the local cache")
    assert "via tier" not in loader.describe()
    files = loader.storage_files()
    assert files and all(f.startswith(str(own_cache)) for f in files)  # evictable: on the local disk
    before = tier_counters(dataset.fs)["bytes"]
    assert len(epoch_inputs(loader)) == 4 and tier_counters(dataset.fs)["bytes"] == before
    explicit = _config(tmp_path, {"name": "remote", "base": f"memory://{root}"},
                       pipeline={"batch_size": 4, "image_size": 24}, storage={"converted": f"memory://{root}-elsewhere"})
    with pytest.raises(DatasetError, match=r"cannot write the converted dataset there \(PermissionError.*"
                                           r"set storage.converted") as info:
        prepared_loader(explicit, open_dataset(explicit), backend, settings)
    assert "\n" not in str(info.value)


def test_the_bench_tables_stall_says_whose_it_is():
    from rich.console import Console

    from loadopt.cli.tables import results_table

    base = {"samples_per_s": 100.0, "mb_per_s": 11.0, "wait_p99_ms": 3.0, "cpu_seconds_per_1k_samples": 1.0,
            "peak_pss_mb": 100.0}
    split = {**base, "stall_fraction": {"median": 0.375, "min": 0.37, "max": 0.38},
             "loader_stall_fraction": {"median": 0.371, "min": 0.36, "max": 0.38}, "finish_stall_fraction": 0.004}
    cuda = {**base, "stall_fraction": 0.2, "loader_stall_fraction": None, "finish_stall_fraction": None}
    results = ResultsFile.model_validate(
        {"config": {"name": "t"}, "device": "cpu", "dataset": {"num_samples": 8}, "ranking": ["a", "b"],
         "runs": [{"label": "a", "metrics": split}, {"label": "b", "metrics": cuda}]})
    console = Console(width=250, record=True)
    console.print(results_table(results))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "stall" in line).split()
    assert header[header.index("stall"):header.index("stall") + 3] == ["stall", "loader", "finish"]
    row_a = next(line for line in lines if line.split()[1:2] == ["a"]).split()
    row_b = next(line for line in lines if line.split()[1:2] == ["b"]).split()
    assert "37.5% 37.1% 0.4%" in " ".join(row_a)
    assert "20.0% - -" in " ".join(row_b)  # CUDA: no split
