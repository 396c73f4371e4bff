"""Records read by the ring backends (posix raw shards, arrow, kvikio's logic on the CPU; cuFile on a GPU):
each delivers every record's first `delivered_bytes`, zero-padded, as the torch backend does, and counts
each record's stored bytes whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loadopt.config import config_from_dict
from loadopt.errors import DatasetError
from loadopt.loaders.arrow.loader import ArrowLoader, ArrowSettings
from loadopt.loaders.posix.loader import PosixLoader, PosixSettings
from loadopt.loaders.registry import backend_class
from loadopt.storage.open import open_dataset

from .test_records import records_config


def records_dataset(tmp_path, file_format: str):
    # sizes spread around the delivered 30,000 bytes: some records are cut, others zero-padded
    config = config_from_dict(records_config(tmp_path, file_format, record_bytes=30_000, record_bytes_stdev=8_000),
                              "rec.yaml")
    return config, open_dataset(config)


def expected_rows(dataset, indices) -> np.ndarray:
    out = np.ones((len(indices), dataset.delivered_bytes), np.uint8)
    for row, index in zip(out, indices, strict=True):
        dataset.read_into(int(index), row)
    return out


def host_batches(loader) -> list[tuple[np.ndarray, np.ndarray, int | None]]:
    loader.prepare()
    try:
        return [(b.inputs.cpu().numpy().copy(), b.indices.copy(), b.bytes_read) for b in loader.host_batches()]
    finally:
        loader.close()


def check_records(dataset, batches) -> None:
    seen = np.concatenate([indices for _, indices, _ in batches])
    assert sorted(seen.tolist()) == list(range(len(dataset)))  # every record once an epoch
    assert len({len(b[1]) for b in batches[:-1]}) == 1
    for rows, indices, read in batches:
        assert rows.dtype == np.uint8 and rows.shape == (len(indices), dataset.delivered_bytes)
        assert np.array_equal(rows, expected_rows(dataset, indices))
        assert read is not None and read >= int(dataset.sizes[indices].sum())  # each record read whole


@pytest.mark.parametrize("file_format", ["npz", "raw"])
def test_posix_reads_records_from_raw_shards(tmp_path, file_format):
    config, dataset = records_dataset(tmp_path, file_format)
    sizes = dataset.sizes
    assert (sizes < dataset.delivered_bytes).any() and (sizes > dataset.delivered_bytes).any()
    assert PosixLoader.supports(dataset) == (True, "")
    loader = PosixLoader(dataset, config.pipeline, PosixSettings(shard_mib=0.05, task_kib=16), seed=3)
    assert loader.layout == "records" and loader.describe().startswith("records")
    batches = host_batches(loader)
    check_records(dataset, batches)
    assert len(loader.raw.shards) > 1  # records spread over several shards, read by byte range
    assert all(read % 4096 == 0 for _, _, read in batches)  # 4 KiB aligned reads (O_DIRECT can take them)


def test_posix_reads_records_with_o_direct(tmp_path):
    config, dataset = records_dataset(tmp_path, "raw")
    loader = PosixLoader(dataset, config.pipeline, PosixSettings(o_direct=True), seed=3)
    try:
        batches = host_batches(loader)
    except DatasetError as exc:
        if "refuses O_DIRECT" in str(exc):
            pytest.skip(f"this filesystem refuses O_DIRECT ({exc})")
        raise
    check_records(dataset, batches)


@pytest.mark.parametrize("file_format", ["npz", "raw"])
def test_arrow_reads_records_and_keeps_the_conversion(tmp_path, file_format):
    config, dataset = records_dataset(tmp_path, file_format)
    assert ArrowLoader.supports(dataset) == (True, "")
    loader = ArrowLoader(dataset, config.pipeline, ArrowSettings(), seed=3)
    batches = host_batches(loader)
    check_records(dataset, batches)
    from loadopt.storage.forms.arrow_format import arrow_path

    path = arrow_path(dataset, "records", None) / "manifest.json"
    written = path.stat().st_mtime_ns
    again = host_batches(ArrowLoader(dataset, config.pipeline, ArrowSettings(), seed=3))
    assert path.stat().st_mtime_ns == written  # converted once, then reused
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


def test_arrow_record_batches_hold_large_records_by_bytes(tmp_path, monkeypatch):
    from loadopt.storage.forms import arrow_format

    monkeypatch.setattr(arrow_format, "RECORD_BATCH_BYTES", 100_000)  # a few records a record batch
    config, dataset = records_dataset(tmp_path, "npz")
    step = arrow_format.rows_per_batch(dataset, "records")
    assert 1 <= step < len(dataset)
    loader = ArrowLoader(dataset, config.pipeline, ArrowSettings(), seed=3)
    batches = host_batches(loader)
    check_records(dataset, batches)


def test_kvikio_logic_reads_records_on_the_cpu(tmp_path):
    from .test_kvikio import kvikio_on_the_cpu

    config, dataset = records_dataset(tmp_path, "npz")
    loader = kvikio_on_the_cpu(dataset, config.pipeline, PosixSettings(shard_mib=0.05), seed=3)
    assert loader.supports(dataset) == (True, "")
    check_records(dataset, host_batches(loader))


@pytest.mark.gpu
def test_kvikio_reads_records_with_cufile(tmp_path):
    available, reason = backend_class("kvikio").available()
    if not available:
        pytest.skip(reason)
    config, dataset = records_dataset(tmp_path, "raw")
    from loadopt.loaders.kvikio.loader import KvikioLoader

    loader = KvikioLoader(dataset, config.pipeline, PosixSettings(), seed=3, device=torch.device("cuda"))
    check_records(dataset, host_batches(loader))


def test_backends_that_do_not_read_records_say_why(tmp_path):
    _, dataset = records_dataset(tmp_path, "npz")
    for name in ("dali",):
        ok, why = backend_class(name).supports(dataset)
        assert not ok and "records" in why


@pytest.mark.parametrize("to", ["raw", "arrow"])
def test_conversions_store_records_whole(tmp_path, to):
    from loadopt.storage.forms import conversions

    config, dataset = records_dataset(tmp_path, "npz")
    form = conversions.converted_form(config.pipeline, "decoded", None, "auto", False, "--size", records=True)
    assert (form.form, form.stored, form.size, form.describe()) == ("records", "records", None, "records")
    done = conversions.convert(to, dataset, form)
    assert done.samples == len(dataset) and done.nbytes >= int(dataset.sizes.sum()) and not done.skipped
    assert conversions.convert(to, dataset, form).reused  # what the backends' prepare reuses


@pytest.mark.parametrize("to", ["raw", "arrow"])
def test_loadopt_convert_stores_records_once(tmp_path, to):
    """`loadopt convert` on a records config writes the records form the backends read, then reuses it."""
    import yaml

    from .test_cli import loadopt

    path = tmp_path / "rec.yaml"
    path.write_text(yaml.safe_dump(records_config(tmp_path, "npz")))
    cache = tmp_path / "cache"
    first = loadopt("convert", path, "--to", to, env_cache=cache)
    assert first.returncode == 0, first.stderr
    assert "15 samples" in first.stdout and "records" in first.stdout
    again = loadopt("convert", path, "--to", to, env_cache=cache)
    assert again.returncode == 0 and "reused" in again.stdout, again.stdout + again.stderr
