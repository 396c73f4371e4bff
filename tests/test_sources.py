"""WebDataset tar shards and Parquet files (the Hugging Face layout) as datasets: their indexes, labels,
bytes, cached indexes, format detection, remote reads, and the backends reading them in the shared order."""

from __future__ import annotations

import json
import os
import pickle
import tarfile
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loadopt import make_loader
from loadopt.config import load_config
from loadopt.errors import DatasetError
from loadopt.storage.open import open_dataset
from loadopt.storage.sources import parquet as parquet_source
from loadopt.storage.sources import webdataset as webdataset_source
from loadopt.storage.sources.parquet import open_parquet
from loadopt.storage.sources.webdataset import open_webdataset

from .conftest import make_image_folder, tiny_config_dict
from .servers import python_http_server, s3_endpoint  # noqa: F401 - s3_endpoint is a fixture
from .source_files import folder_samples, write_parquet, write_shards


@pytest.fixture
def image_folder(tmp_path) -> Path:
    make_image_folder(tmp_path / "folder", classes=3, per_class=4)
    return tmp_path / "folder"


@pytest.mark.parametrize("tar_format", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_webdataset_index_labels_and_bytes(tmp_path, image_folder, tar_format, own_cache):
    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=5, tar_format=tar_format, extra=True)
    with pytest.raises(DatasetError, match=r"train-000000.tar \(sample deep/x+: no image member; members: txt\)"):
        open_webdataset(str(tmp_path / "shards"))
    dataset = open_webdataset(str(tmp_path / "shards"), on_error="skip")
    assert len(dataset) == len(samples) and dataset.kind == "images"
    assert dataset.labels.dtype == np.int64 and dataset.labels.tolist() == [label for _, label, _ in samples]
    assert dataset.classes == ["0", "1", "2"]
    assert [dataset.read(i) for i in range(len(dataset))] == [data for _, _, data in samples]
    assert dataset.sizes.tolist() == [len(data) for _, _, data in samples]
    assert len(dataset.left_out) == 1 and "deep/" + "x" * 120 in dataset.left_out[0]
    assert dataset.path(6).startswith(str(tmp_path / "shards" / "train-000001.tar") + " (sample s0006, bytes ")
    assert dataset.is_local() and len(dataset.local_files()) == 3 and not dataset.synthetic
    assert dataset.converted is None and dataset.root == str(tmp_path / "shards")


def test_webdataset_json_label_brace_pattern_and_split(tmp_path, image_folder, own_cache):
    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples[:8], per_shard=4, labels_in="json")
    write_shards(tmp_path / "shards", samples[8:], per_shard=4, split="val", labels_in="json")
    pattern = str(tmp_path / "shards" / "train-{000000..000001}.tar")
    train = open_webdataset(pattern, label_key="target")
    assert train.labels.tolist() == [label for _, label, _ in samples[:8]]
    val = open_webdataset(pattern, split="val", label_key="target")  # train- swapped for val- in the pattern
    assert val.labels.tolist() == [label for _, label, _ in samples[8:]] and val.read(0) == samples[8][2]
    assert open_webdataset(str(tmp_path / "shards"), split="val", label_key="target").fingerprint == val.fingerprint
    with pytest.raises(DatasetError, match="no `cls` member"):
        open_webdataset(str(tmp_path / "shards"))


def test_webdataset_index_is_cached(tmp_path, image_folder, own_cache, monkeypatch):
    samples = folder_samples(image_folder)
    shards = write_shards(tmp_path / "shards", samples, per_shard=6)
    opened = []
    real_reader = webdataset_source._reader
    monkeypatch.setattr(webdataset_source, "_reader", lambda fs, name: opened.append(name) or real_reader(fs, name))
    first = open_webdataset(str(tmp_path / "shards"))
    assert len(opened) == 2
    second = open_webdataset(str(tmp_path / "shards"))
    assert len(opened) == 2  # the second open read no shard
    assert second.fingerprint == first.fingerprint and second.labels.tolist() == first.labels.tolist()
    write_shards(tmp_path / "shards", samples[:6], per_shard=6)  # shard 0 rewritten, shard 1 unchanged
    os.utime(shards[0], (1_800_000_000, 1_800_000_000))
    third = open_webdataset(str(tmp_path / "shards"))
    assert len(opened) == 4 and third.fingerprint != first.fingerprint


def test_truncated_shard_names_the_offset(tmp_path, image_folder, own_cache):
    (shard,) = write_shards(tmp_path / "shards", folder_samples(image_folder)[:3], per_shard=3)
    shard.write_bytes(shard.read_bytes()[:1500])
    with pytest.raises(DatasetError, match=r"train-000000.tar: truncated at offset \d+"):
        open_webdataset(str(tmp_path / "shards"))


@pytest.mark.parametrize("hf", [True, False])
def test_parquet_index_labels_and_bytes(tmp_path, image_folder, hf, own_cache, monkeypatch):
    samples = folder_samples(image_folder)
    write_parquet(tmp_path / "pq", samples, ["c0", "c1", "c2"], hf=hf)
    columns = {} if hf else {"image_column": "jpg", "label_column": "cls"}
    dataset = open_parquet(str(tmp_path / "pq"), **columns)
    assert len(dataset) == len(samples) and dataset.labels.dtype == np.int64
    assert dataset.labels.tolist() == [label for _, label, _ in samples]
    assert dataset.classes == (["c0", "c1", "c2"] if hf else ["0", "1", "2"])
    assert dataset.sizes.tolist() == [len(data) for _, _, data in samples]
    reads = []
    real = parquet_source.ParquetDataset.read_group
    monkeypatch.setattr(parquet_source.ParquetDataset, "read_group",
                        lambda self, f, g, handle: reads.append((f, g)) or real(self, f, g, handle))
    assert [dataset.read(i) for i in range(len(dataset))] == [data for _, _, data in samples]
    assert len(reads) == 4  # 2 files of 2 row groups (3 rows each): each row group read once
    assert dataset.path(7) == f"{dataset.files[1].decode()} (row group 0, row 1)"
    assert dataset.is_local() and len(dataset.local_files()) == 2
    copied = pickle.loads(pickle.dumps(dataset))  # as a worker process gets it: no open file, no decoded rows
    assert not copied.row_groups.groups and copied.read(7) == samples[7][2]
    indexed = []
    monkeypatch.setattr(parquet_source, "_index_files", lambda *a: indexed.append(a))
    assert open_parquet(str(tmp_path / "pq"), **columns).fingerprint == dataset.fingerprint and not indexed


def test_parquet_reads_from_many_threads_at_once(tmp_path, own_cache, monkeypatch):
    """`source_digest` and the torch workers' threads read one file's row groups at once: every thread gets
    its sample's bytes, each row group still read once at a time (Arrow aborted on a shared ParquetFile)."""
    from concurrent.futures import ThreadPoolExecutor
    samples = [(f"s{i:03d}", i % 3, os.urandom(64 + i)) for i in range(240)]
    write_parquet(tmp_path / "pq", samples, ["c0", "c1", "c2"], files=1, rows_per_group=4)
    dataset = open_parquet(str(tmp_path / "pq"))
    monkeypatch.setattr(parquet_source, "ROW_GROUP_CACHE_BYTES", 1 << 30)
    reads = []
    real = parquet_source.ParquetDataset.read_group
    monkeypatch.setattr(parquet_source.ParquetDataset, "read_group",
                        lambda self, f, g, handle: reads.append((f, g)) or real(self, f, g, handle))
    for _ in range(3):
        dataset.row_groups = parquet_source.RowGroupCache()
        reads.clear()
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(dataset.read, range(len(dataset))))
        assert got == [data for _, _, data in samples]
        assert sorted(reads) == sorted(set(reads)) and len(reads) == 60


def test_parquet_row_groups_held_by_their_bytes(tmp_path, own_cache, monkeypatch):
    samples = [(f"s{i:03d}", 0, bytes([i]) * 1000) for i in range(12)]
    write_parquet(tmp_path / "pq", samples, ["c0"], files=1, rows_per_group=4)
    dataset = open_parquet(str(tmp_path / "pq"))
    monkeypatch.setattr(parquet_source, "ROW_GROUP_CACHE_BYTES", 8500)  # two groups of 4 x 1000 bytes, not three
    cache = dataset.row_groups
    for index in (0, 4, 8):
        dataset.read(index)
    assert list(cache.groups) == [(0, 1), (0, 2)] and cache.held == sum(a.nbytes for a in cache.groups.values())
    assert dataset.read(1) == samples[1][2] and list(cache.groups) == [(0, 2), (0, 0)]


def test_parquet_string_labels_and_missing_column(tmp_path, image_folder, own_cache):
    samples = folder_samples(image_folder)
    names = ["cat", "dog", "eel"]
    table = pa.table({"image": pa.array([d for _, _, d in samples], pa.binary()),
                      "label": pa.array([names[label] for _, label, _ in samples])})
    pq.write_table(table, tmp_path / "named.parquet", row_group_size=5)
    dataset = open_parquet(str(tmp_path / "named.parquet"))
    assert dataset.classes == names and dataset.labels.tolist() == [label for _, label, _ in samples]
    with pytest.raises(DatasetError, match=r"no column 'picture' \(columns: image, label\)"):
        open_parquet(str(tmp_path / "*.parquet"), image_column="picture")


def _config(tmp_path: Path, path: str, **dataset):
    tmp_path.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(tmp_path / "results", dataset={"path": path, **dataset})
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    return load_config(tmp_path / "c.yaml")


def test_auto_detects_each_format_and_names_what_else_is_there(tmp_path, image_folder, own_cache):
    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=6)
    write_parquet(tmp_path / "hub", samples, ["c0", "c1", "c2"])
    found = {name: type(open_dataset(_config(tmp_path, str(path)))).__name__
             for name, path in (("folder", image_folder), ("shards", tmp_path / "shards"), ("hub", tmp_path / "hub"),
                                ("pattern", tmp_path / "shards" / "train-{000000..000001}.tar"),
                                ("file", tmp_path / "hub" / "data" / "train-00000-of-00002.parquet"))}
    assert found == {"folder": "ImageDataset", "shards": "WebDataset", "hub": "ParquetDataset",
                     "pattern": "WebDataset", "file": "ParquetDataset"}
    (tmp_path / "notes").mkdir()
    for name in ("a.txt", "b.csv"):
        (tmp_path / "notes" / name).write_text("x")
    with pytest.raises(DatasetError) as caught:
        open_dataset(_config(tmp_path, str(tmp_path / "notes")))
    message = str(caught.value)
    assert "\n" not in message and "found 2 file(s): a.txt, b.csv" in message and ".tar shards" in message
    forced = open_dataset(_config(tmp_path, str(tmp_path / "hub"), format="parquet", columns={"image": "image"}))
    assert type(forced).__name__ == "ParquetDataset"


def test_remote_shards_and_parquet(tmp_path, image_folder, own_cache):
    samples = folder_samples(image_folder)
    shards = write_shards(tmp_path / "shards", samples, per_shard=5)
    files = write_parquet(tmp_path / "hub", samples, ["c0", "c1", "c2"])
    memory = fsspec.filesystem("memory")
    for path in shards + files:
        memory.pipe(f"/sources/{path.relative_to(tmp_path)}", path.read_bytes())
    remote = open_parquet("memory://sources/hub")
    assert not remote.is_local() and remote.local_files() == []
    assert [remote.read(i) for i in range(len(remote))] == [data for _, _, data in samples]
    assert remote.classes == ["c0", "c1", "c2"]
    in_memory = open_webdataset("memory://sources/shards")
    assert [in_memory.read(i) for i in range(len(in_memory))] == [data for _, _, data in samples]
    with python_http_server(tmp_path) as url:
        over_http = open_webdataset(f"{url}/shards/train-{{000000..000002}}.tar")
        assert over_http.labels.tolist() == [label for _, label, _ in samples]
        assert over_http.read(7) == samples[7][2] and over_http.root == f"{url}/shards"


def _epoch_labels(config, backend: str, **settings) -> list[int]:
    loader = make_loader(config, backend=backend, seed=5, **settings)
    try:
        return [label for _, labels in loader for label in labels.tolist()]
    finally:
        loader.close()


def test_backends_read_every_format_in_the_same_order(tmp_path, image_folder, own_cache):
    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=5)
    write_parquet(tmp_path / "hub", samples, ["c0", "c1", "c2"])
    runs = (("torch", {"variant": "plain", "num_workers": 0}), ("torch", {"variant": "tuned", "num_workers": 0}),
            ("arrow", {"form": "decoded"}), ("posix", {}))
    configs = {name: _config(tmp_path / name, str(path))
               for name, path in (("folder", image_folder), ("shards", tmp_path / "shards"), ("hub", tmp_path / "hub"))}
    for backend, settings in runs:
        expected = _epoch_labels(configs["folder"], backend, **settings)
        assert sorted(expected) == sorted(label for _, label, _ in samples)
        for name in ("shards", "hub"):
            assert _epoch_labels(configs[name], backend, **settings) == expected, (name, backend, settings)


def test_dali_native_reader_refuses_tar_shards_and_parquet_in_one_line(tmp_path, image_folder, own_cache):
    """DALI's file reader opens one file per sample: handed a shard it would decode the tar as an image."""
    pytest.importorskip("nvidia.dali")
    from loadopt.errors import ConfigError

    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=5)
    write_parquet(tmp_path / "hub", samples, ["c0", "c1", "c2"])
    for name in ("shards", "hub"):
        config = _config(tmp_path / f"{name}-config", str(tmp_path / name))
        with pytest.raises(ConfigError, match="reader native reads local ImageFolder files only; use reader: "
                                              "external for remote, tar-shard or Parquet datasets"):
            make_loader(config, backend="dali", reader="native", decoder="cpu")
    assert _epoch_labels(_config(tmp_path / "external", str(tmp_path / "shards")), "dali", reader="external",
                         decoder="cpu") == _epoch_labels(_config(tmp_path / "folder", str(image_folder)), "dali",
                                                          reader="external", decoder="cpu")


def test_bench_under_skip_counts_and_names_what_it_left_out(tmp_path, image_folder, own_cache):
    """dataset.on_error: skip on tar shards: a sample without an image member is left out when indexed, one of
    other bytes when read; results.json names both and says the source's format."""
    from typer.testing import CliRunner

    from loadopt.cli import app
    from loadopt.schema.documents import ResultsFile

    from .source_files import LONG_KEY

    samples = folder_samples(image_folder)
    key, label, _ = samples[3]
    samples[3] = (key, label, b"not an image at all" * 10)
    shards = write_shards(tmp_path / "shards", samples, per_shard=5, extra=True)
    raw = tiny_config_dict(tmp_path / "results", dataset={"path": str(tmp_path / "shards"), "on_error": "skip"})
    (tmp_path / "job.yaml").write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["bench", str(tmp_path / "job.yaml"), "--quick", "--loaders", "torch"])
    assert result.exit_code == 0, result.output
    results = ResultsFile.model_validate_json((tmp_path / "results" / "results.json").read_text())
    assert results.dataset.format == "webdataset" and results.dataset.num_samples == len(samples)
    assert results.dataset.left_out == [f"{shards[0]} (sample {LONG_KEY}: no image member; members: txt)"]
    skipped = {f.path for run in results.runs for f in run.skipped_files}
    assert skipped and all(path.startswith(f"{shards[0]} (sample {key}, bytes ") for path in skipped), skipped
    said = " ".join(result.output.split())
    assert "1 sample(s) left out when indexed" in said and "unreadable file(s) skipped" in said


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_peer_reads_the_datasets_own_shards(tmp_path, image_folder, own_cache, workers):
    """On tar shards, WebDataset's own loop reads them as they are (no conversion): every indexed sample once
    an epoch, a sample without an image member passed over, each with the torch path's crop and label."""
    pytest.importorskip("webdataset")
    import torch

    from loadopt.loaders.registry import backend_class
    from loadopt.loaders.torch_dl.loader import TorchLoader, TorchSettings

    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=5, extra=True)
    config = _config(tmp_path / "cfg", str(tmp_path / "shards"), on_error="skip")
    dataset = open_dataset(config)
    cls = backend_class("webdataset")
    loader = cls(dataset, config.pipeline, cls.Settings(num_workers=workers), seed=3)
    try:
        loader.prepare()
        assert loader.storage_files() == dataset.local_files() and not list(own_cache.rglob("*.tar"))
        assert "the dataset's own tar shards" in loader.describe() and not loader.reads_conversion()
        got = {}
        for batch in loader.host_batches():
            got.update({int(i): (batch.inputs[k].clone(), int(batch.labels[k])) for k, i in enumerate(batch.indices)})
    finally:
        loader.close()
    assert sorted(got) == list(range(len(samples)))
    reference = TorchLoader(dataset, config.pipeline, TorchSettings(num_workers=0), seed=3)
    for batch in reference.host_batches():
        for k, index in enumerate(batch.indices):
            pixels, label = got[int(index)]
            assert torch.equal(pixels, batch.inputs[k]) and label == int(batch.labels[k]), f"sample {index}"


def test_shards_from_webdatasets_own_writer_and_both_formats_over_s3(tmp_path, image_folder, own_cache,
                                                                        s3_endpoint):  # noqa: F811 - a fixture
    """Shards written by webdataset's ShardWriter read as written; both formats read from S3 (moto) by ranges,
    and torch delivers the same labels in the same order from there as from the local copy; their raw and Arrow
    conversions are written to S3 beside them (the shards' data there, only the reference here) and deliver
    the same labels as the local copy's."""
    wds = pytest.importorskip("webdataset")
    import s3fs

    samples = folder_samples(image_folder)
    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "train-%06d.tar"), maxcount=5, verbose=0) as sink:
        for key, label, data in samples:
            sink.write({"__key__": key, "jpg": data, "cls": label})
    written = open_webdataset(str(tmp_path / "wds"))
    assert written.labels.tolist() == [label for _, label, _ in samples] and len(written.shards) == 3
    assert [written.read(i) for i in range(len(written))] == [data for _, _, data in samples]
    write_parquet(tmp_path / "hub", samples, ["c0", "c1", "c2"])
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("loadopt-sources")
    fs.put(f"{tmp_path / 'wds'}/", "loadopt-sources/wds/", recursive=True)
    fs.put(f"{tmp_path / 'hub'}/", "loadopt-sources/hub/", recursive=True)
    for name in ("wds", "hub"):
        local = _config(tmp_path / f"{name}-local", str(tmp_path / name))
        remote = _config(tmp_path / f"{name}-s3", f"s3://loadopt-sources/{name}")
        dataset = open_dataset(remote)
        assert not dataset.is_local() and dataset.read(7) == samples[7][2]
        assert _epoch_labels(remote, "torch", num_workers=0) == _epoch_labels(local, "torch", num_workers=0)
        for backend, data in (("arrow", ".arrow"), ("posix", ".bin")):  # converted into the bucket, read back
            settings = {"form": "decoded", "shard_mib": 0.05}
            expected = _epoch_labels(local, backend, **settings)
            here = set(own_cache.rglob(f"*{data}"))  # the local copy's conversion
            assert _epoch_labels(remote, backend, **settings) == expected, (name, backend)
            uploaded = [p for p in fs.find(f"loadopt-sources/{name}") if p.endswith(data) and "/.loadopt/" in p]
            assert len(uploaded) > 1, (name, backend)  # several shards, on S3
            assert set(own_cache.rglob(f"*{data}")) == here  # and none of them here
