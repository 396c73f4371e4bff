"""The bad-input cases of the shard formats (tar shards, Parquet), of a folder holding no format and of a
remote dataset changed since it was listed, for tests/test_bad_inputs.py's table: each prepares a dataset
and says the one line `loadopt bench` must print."""

from __future__ import annotations

import re
from contextlib import ExitStack

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from loadopt import make_loader
from loadopt.cli import app
from loadopt.errors import LoadoptError

from .faults import Setup, images, temps, write_config
from .servers import python_http_server
from .source_files import LONG_KEY, folder_samples, write_parquet, write_shards


def _shard_set(tmp_path, extra: bool = False, bad_image: int | None = None):
    """Tar shards of 10 photos (5 a shard), `extra` a sample with no image member, `bad_image` a sample whose
    image member holds other bytes; and a config reading them."""
    root, _ = images(tmp_path, corrupt=0)
    samples = folder_samples(root)
    if bad_image is not None:
        key, label, _ = samples[bad_image]
        samples[bad_image] = (key, label, b"not an image at all" * 10)
    shards = write_shards(tmp_path / "shards", samples, per_shard=5, extra=extra)
    return shards, write_config(tmp_path, dataset={"path": str(tmp_path / "shards")})


def truncated_tar_shard(tmp_path, cache):
    shards, config = _shard_set(tmp_path)
    shards[1].write_bytes(shards[1].read_bytes()[:3000])  # an upload cut short
    return Setup(["bench", str(config)], f"{shards[1]}: truncated at offset ", config=config, backend="torch",
                 leftovers=temps(cache))


def tar_sample_without_an_image(tmp_path, cache):
    shards, config = _shard_set(tmp_path, extra=True)
    return Setup(["bench", str(config)], f"{shards[0]} (sample {LONG_KEY}: no image member; members: txt); set "
                 "dataset.on_error: skip to leave it out", config=config, backend="torch")


def empty_tar_shard(tmp_path, cache):
    _, config = _shard_set(tmp_path)
    empty = tmp_path / "shards" / "train-000002.tar"
    empty.write_bytes(b"")
    return Setup(["bench", str(config)], f"{empty} (an empty file: 0 bytes, no tar header)", config=config,
                 backend="torch")


def tar_sample_of_other_bytes(tmp_path, cache):
    """Met while reading, not while opening: the library's error is raised by the epoch that reads it."""
    shards, config = _shard_set(tmp_path, bad_image=3)
    culprit = f"{shards[0]} (sample s0003, bytes "

    def library_raises_while_reading() -> None:
        assert not (tmp_path / "results").exists(), "results of a bench that measured nothing"
        loader = make_loader(config, backend="torch", num_workers=0)
        try:
            with pytest.raises(LoadoptError, match=re.escape(culprit)):
                for _ in loader:
                    pass
        finally:
            loader.close()

    return Setup(["bench", str(config), "--loaders", "torch"], culprit, config=config,
                 after=library_raises_while_reading)


def _parquet_set(tmp_path, **dataset):
    root, _ = images(tmp_path, corrupt=0)
    files = write_parquet(tmp_path / "hub", folder_samples(root), ["c0", "c1"])
    return files, write_config(tmp_path, dataset={"path": str(tmp_path / "hub"), **dataset})


def parquet_without_the_named_column(tmp_path, cache):
    files, config = _parquet_set(tmp_path, columns={"image": "picture"})
    return Setup(["bench", str(config)], f"{files[0]}: no column 'picture' (columns: image, label); set "
                 "dataset.columns", config=config, backend="torch")


def parquet_files_of_different_schemas(tmp_path, cache):
    files, config = _parquet_set(tmp_path)
    table = pq.read_table(files[1])
    pq.write_table(table.set_column(1, "label", table.column("label").cast(pa.string())), files[1])
    return Setup(["bench", str(config)], f"{files[1]}: its schema differs from {files[0]}'s", config=config,
                 backend="torch")


def dali_native_reader_on_tar_shards(tmp_path, cache):
    pytest.importorskip("nvidia.dali")
    _, config = _shard_set(tmp_path)
    return Setup(["bench", str(config), "--loaders", "dali", "--set", "loaders.dali.reader=native"],
                 "loaders.dali.reader native reads local ImageFolder files only; use reader: external for remote, "
                 "tar-shard or Parquet datasets", config=config, backend="dali",
                 overrides={"reader": "native", "decoder": "cpu"})


def no_dataset_format_in_the_folder(tmp_path, cache):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a dataset")
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "notes")})
    return Setup(["bench", str(config)], f"{tmp_path / 'notes'}: not a dataset loadopt reads (found 1 file(s): "
                 "readme.txt; expected class folders (ImageFolder), .tar shards (WebDataset), .parquet files or a "
                 "Hugging Face save_to_disk folder)",
                 config=config, backend="torch")


def file_removed_since_the_listing(tmp_path, cache):
    """A dataset over HTTP, listed by a first command (its listing saved), one of its files removed since:
    the conversion that reads it names the file, when the dataset was listed, and --relist."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    images(tmp_path, corrupt=0)
    served = ExitStack()
    url = served.enter_context(python_http_server(tmp_path))
    config = write_config(tmp_path, dataset={"path": f"{url}/photos"})
    listed = CliRunner().invoke(app, ["make-dataset", str(config)])
    if listed.exit_code != 0:
        served.close()
    assert listed.exit_code == 0, listed.output
    (tmp_path / "photos" / "train" / "c0" / "1.jpg").unlink()
    return Setup(["convert", str(config), "--to", "arrow"], f"{url}/photos/train/c0/1.jpg: not found: the dataset "
                 "changed since it was listed (", config=config, backend="arrow", overrides={"form": "encoded"},
                 leftovers=temps(cache), close=served.close)


def cache_limit_not_a_size(tmp_path, cache):
    """`storage.cache_limit` that is not a size: refused when the config is read, before anything is fetched."""
    _shard_set(tmp_path)
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "shards")}, storage={"cache_limit": "lots"})
    return Setup(["bench", str(config)], f"{config}: storage.cache_limit: value error, expected a positive size such "
                 "as 500MB, 20GiB or a byte count, got 'lots'", config=config, backend="torch",
                 leftovers=lambda: temps(cache)() + [p for p in [tmp_path / "results", cache / "shard-cache"]
                                                    if p.exists()])


def unknown_shuffle(tmp_path, cache):
    """`pipeline.shuffle` of no known kind: refused when the config is read, naming the key and the kinds."""
    _shard_set(tmp_path)
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "shards")}, pipeline={"shuffle": "windowed"})
    return Setup(["bench", str(config)], f"{config}: pipeline.shuffle: ", config=config, backend="torch",
                 leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])


def arrow_shard_missing(tmp_path, cache):
    """An Arrow conversion whose manifest names a shard that is gone: one line naming the shard and its samples."""
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"arrow": {"form": "encoded"}})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    (shard,) = (cache / "arrow").glob("*-encoded-*/shard-00000.arrow")
    shard.unlink()
    return Setup(["bench", str(config), "--no-convert"],
                 f"{shard}: Arrow shard not found (the manifest lists it: samples 0-", config=config,
                 backend="arrow", overrides={"form": "encoded"})


def raw_shard_missing(tmp_path, cache):
    """A raw conversion whose manifest names a shard that is gone: one line naming the shard and its samples,
    never a silently short dataset."""
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"posix": {"form": "encoded"}})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "raw"]).exit_code == 0
    (shard,) = (cache / "raw").glob("*-encoded-*/shard-00000.bin")
    shard.unlink()
    return Setup(["bench", str(config), "--no-convert"],
                 f"{shard}: shard file not found (the manifest lists it, samples 0-", config=config,
                 backend="posix", overrides={"form": "encoded"})
