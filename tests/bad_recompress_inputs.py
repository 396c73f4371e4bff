"""The bad inputs of `loadopt recompress` (rows of tests/test_bad_inputs.py's table): a source that is no folder,
a folder of no tar shards, the source as its own destination, a damaged tar shard, no imagecodecs; and DALI's
native reader on an ImageFolder holding JPEG XL files. Each leaves no partial shard behind."""

from __future__ import annotations

import sys

import pytest

from .faults import Setup, images, temps, write_config
from .source_files import folder_samples, write_shards


def _shards(tmp_path):
    root, _ = images(tmp_path, corrupt=0)
    source = tmp_path / "shards"
    write_shards(source, folder_samples(root), per_shard=4)
    return source


def _recompress(source, destination, culprit):
    return Setup(["recompress", str(source), str(destination), "--workers", "1"], culprit,
                 leftovers=temps(destination) if destination.is_dir() else lambda: [])


def source_not_a_folder(tmp_path, cache):
    return _recompress(tmp_path / "nowhere", tmp_path / "packed", f"{tmp_path / 'nowhere'}: not a folder of tar shards")


def folder_without_tar_shards(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    return _recompress(root, tmp_path / "packed", f"{root}: no .tar shards in it")


def destination_is_the_source(tmp_path, cache):
    source = _shards(tmp_path)
    return _recompress(source, source, f"{source}: the destination must not be the source folder")


def damaged_tar_shard(tmp_path, cache):
    source = _shards(tmp_path)
    damaged = source / "train-000001.tar"
    damaged.write_bytes(b"\x01" * 2048)
    return _recompress(source, tmp_path / "packed", f"{damaged}: not a readable tar shard")


def recompress_without_imagecodecs(tmp_path, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    return _recompress(_shards(tmp_path), tmp_path / "packed", "JPEG XL images need imagecodecs: pip install "
                       "'loadopt[jxl]'")


def dali_native_reader_on_jpeg_xl_files(tmp_path, cache):
    pytest.importorskip("nvidia.dali")
    imagecodecs = pytest.importorskip("imagecodecs")
    root, _ = images(tmp_path, corrupt=0)
    photo = next((root / "train" / "c0").glob("*.jpg"))
    photo.with_suffix(".jxl").write_bytes(imagecodecs.jpegxl_encode_jpeg(photo.read_bytes()))
    photo.unlink()
    config = write_config(tmp_path, dataset={"path": str(root)})
    return Setup(["bench", str(config), "--loaders", "dali", "--set", "loaders.dali.reader=native"],
                 "loaders.dali.reader native: DALI decodes no JPEG XL", config=config, backend="dali",
                 overrides={"reader": "native", "decoder": "cpu"})


RECOMPRESS_CASES = {  # name: (setup, exit code)
    "recompress: the source is no folder": (source_not_a_folder, 2),
    "recompress: a folder of no tar shards": (folder_without_tar_shards, 2),
    "recompress: the destination is the source": (destination_is_the_source, 2),
    "recompress: a damaged tar shard": (damaged_tar_shard, 1),
    "recompress: imagecodecs not installed": (recompress_without_imagecodecs, 2),
    "dali reader native on JPEG XL files, bench": (dali_native_reader_on_jpeg_xl_files, 2),
}
