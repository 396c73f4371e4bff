"""A raw conversion whose home is S3 (moto's server on loopback; storage/remote_shards.py): each shard's data is
uploaded by whichever process or Ray task wrote it, only the reference (manifest, entries, index rows) stays on the
local disk, another machine opens it from the remote manifest and index files alone, a stopped conversion resumes
from the shards already uploaded, and a damaged remote shard is named by the check. The data is byte for byte that
of the same conversion made on the local disk, and the batches read through the tier are the same."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from loadopt.errors import DatasetError
from loadopt.storage import conversions, raw_convert, remote_shards
from loadopt.storage.conversions import ConvertedForm
from loadopt.storage.convert_engines import ConvertEngine
from loadopt.storage.imagefolder import open_dataset
from loadopt.storage.raw_format import shard_name

from .conftest import epoch_inputs, prepared_loader
from .servers import s3_endpoint  # noqa: F401 - a fixture
from .test_remote_conversion import (
    BUCKET,
    s3_config,
    s3_fs,
    s3_images,  # noqa: F401 - a fixture
)

SHARD_MIB = 0.02  # several shards of the 16 photos
POSIX = {"form": "decoded", "shard_mib": SHARD_MIB}


def _form(config) -> ConvertedForm:
    """What the posix backend reads under the test config (whole frames: augment train): index and frame dims."""
    return conversions.converted_form(config.pipeline, "decoded", None, "auto", False, where="--size")


def _digests_on_s3(folder: str) -> dict[str, str]:
    fs = s3_fs()
    return {path.rsplit("/", 1)[-1]: hashlib.sha256(fs.cat_file(path)).hexdigest()
            for path in sorted(fs.find(folder)) if path.endswith((".bin", ".npy"))}


def _local_reference(tmp_path: Path, images: Path):
    """The same photos converted on the local disk (an NFS-like base: the conversion beside them, whole)."""
    config = s3_config(tmp_path, str(images))
    dataset = open_dataset(config)
    done = conversions.convert("raw", dataset, _form(config), SHARD_MIB)
    return config, dataset, done


def _remote(tmp_path: Path, s3_images, name: str):  # noqa: F811 - the fixture's value
    url, _, endpoint = s3_images
    home = f"s3://{BUCKET}/raw-{name}-{tmp_path.name}"
    config = s3_config(tmp_path, url, endpoint, converted=home)
    return config, open_dataset(config), home.removeprefix("s3://") + "/raw"


def _local_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.name.endswith((".bin", ".npy"))}


def test_the_shards_go_to_s3_and_only_the_reference_stays_here(own_cache, tmp_path, s3_images):  # noqa: F811
    _, images, _ = s3_images
    _, _, reference = _local_reference(tmp_path, images)
    config, dataset, folder = _remote(tmp_path, s3_images, "local")
    done = conversions.convert("raw", dataset, _form(config), SHARD_MIB)
    assert done.shards == reference.shards > 2 and not done.reused
    here = sorted(p.name for p in done.path.iterdir())
    assert not any(name.endswith(".bin") for name in here), here  # the data is on S3 only
    assert "manifest.json" in here and sum(name.endswith(".idx.npy") for name in here) == done.shards
    on_s3 = _digests_on_s3(folder)
    assert on_s3 == _local_digests(reference.path)  # the same shards and index rows as on the local disk
    assert done.nbytes >= sum(p.stat().st_size for p in reference.path.glob("*.bin"))
    assert not list((own_cache / "raw").glob(".upload-*"))  # the writers' temporary folders are gone


def test_another_machine_reads_it_from_the_remote_manifest_and_index(own_cache, tmp_path, s3_images):  # noqa: F811
    _, images, _ = s3_images
    ref_config, ref_dataset, _ = _local_reference(tmp_path, images)
    expected = epoch_inputs(prepared_loader(ref_config, ref_dataset, "posix", POSIX))
    config, dataset, _ = _remote(tmp_path, s3_images, "other")
    made = conversions.convert("raw", dataset, _form(config), SHARD_MIB)
    shutil.rmtree(own_cache)  # a machine that did not convert it: nothing of it on its disk
    again = open_dataset(config)
    loader = prepared_loader(config, again, "posix", POSIX)
    assert loader.raw.root == made.path and not list(made.path.glob("*.bin"))  # the reference only, fetched
    batches = epoch_inputs(loader)
    assert len(batches) == len(expected) and all(torch.equal(a, b) for a, b in zip(batches, expected, strict=True))
    assert conversions.convert("raw", open_dataset(config), _form(config), SHARD_MIB).reused


def test_a_stopped_conversion_resumes_from_the_shards_already_on_s3(own_cache, tmp_path, s3_images,  # noqa: F811
                                                                   monkeypatch):
    config, dataset, _ = _remote(tmp_path, s3_images, "resume")
    uploaded: list[str] = []
    upload = remote_shards.RemoteShards.upload

    def counted(self, local, name):
        upload(self, local, name)
        uploaded.append(name)

    def stop_after_two(done: int, total: int) -> None:
        if len(uploaded) >= 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(remote_shards.RemoteShards, "upload", counted)
    with pytest.raises(KeyboardInterrupt):
        form = _form(config)  # one writer, this process: its uploads are counted here
        raw_convert.convert(dataset, form.stored, form.size, SHARD_MIB, progress=stop_after_two, workers=1)
    first = list(uploaded)
    uploaded.clear()
    raw_convert.convert(dataset, form.stored, form.size, SHARD_MIB, workers=1)
    done = conversions.convert("raw", dataset, form, SHARD_MIB)
    assert len(first) >= 2 and not set(first) & set(uploaded), (first, uploaded)  # the uploaded ones kept
    assert len(first) + len(uploaded) == done.shards


def test_a_damaged_shard_on_s3_is_named_by_the_check(own_cache, tmp_path, s3_images):  # noqa: F811
    config, dataset, folder = _remote(tmp_path, s3_images, "damaged")
    form = _form(config)
    done = conversions.convert("raw", dataset, form, SHARD_MIB)
    fs = s3_fs()
    target = f"{next(p for p in fs.find(folder) if p.endswith('/' + done.path.name + '/' + shard_name(1)))}"
    data = bytearray(fs.cat_file(target))
    data[100] ^= 0xFF
    fs.pipe_file(target, bytes(data))
    with pytest.raises(DatasetError, match=rf"s3://.*{shard_name(1)}: chunk 0"):
        raw_convert.open_conversion(dataset, form.stored, form.size, SHARD_MIB, verify="all")


def test_ray_tasks_upload_their_shards_without_the_drivers_folder(own_cache, tmp_path, s3_images):  # noqa: F811
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    _, images, _ = s3_images
    _, _, reference = _local_reference(tmp_path, images)
    config, dataset, folder = _remote(tmp_path, s3_images, "ray")
    elsewhere = tmp_path / "workers-cache"  # the tasks' own disk: the driver's folder is not there
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"LOADOPT_CACHE": str(elsewhere)}})
    try:
        done = conversions.convert("raw", dataset, _form(config), SHARD_MIB, engine=ConvertEngine("ray"))
    finally:
        ray.shutdown()
    assert _digests_on_s3(folder) == _local_digests(reference.path)
    assert not list(done.path.glob("*.bin"))
    assert not list((elsewhere / "raw").glob(".upload-*"))  # each task's temporary folder removed


def test_storage_converted_moved_converts_at_the_new_home_and_leaves_the_old(own_cache, tmp_path, s3_images,  # noqa: F811
                                                                            caplog):
    config, dataset, _ = _remote(tmp_path, s3_images, "first")
    form = _form(config)
    first = conversions.convert("raw", dataset, form, SHARD_MIB)
    _, moved, _ = _remote(tmp_path, s3_images, "second")  # storage.converted changed: the same local reference
    with pytest.raises(DatasetError, match=r"whose shards are not at s3://.*raw-second.*changed since.*"
                                           r"loadopt convert CONFIG --to raw") as raised:  # opened, not converted
        raw_convert.open_conversion(moved, form.stored, form.size, SHARD_MIB)
    assert "\n" not in str(raised.value)
    with caplog.at_level("WARNING"):
        again = conversions.convert("raw", moved, form, SHARD_MIB)
    assert "storage.converted changed since): converting there" in caplog.text
    assert not again.reused and again.data_at is not None and "raw-second" in again.data_at
    assert first.data_at is not None and s3_fs().exists(first.data_at.removeprefix("s3://"))  # the old home left
