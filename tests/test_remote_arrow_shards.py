"""An Arrow conversion whose home is S3 (moto's server on loopback; storage/remote_shards.py): each shard is uploaded
by whichever process or Ray task wrote it, only the reference (manifest, entries, each shard's outline:
storage/arrow_outline.py) stays on the local disk, another machine opens it from the remote manifest and outlines
alone, a stopped conversion resumes from the shards already uploaded, and a damaged remote shard is named by the
check. The shards are byte for byte those of the same conversion made on the local disk, and the batches read
through the tier are the same."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loadopt.errors import DatasetError
from loadopt.storage import arrow_convert, conversions, remote_shards
from loadopt.storage.arrow_format import shard_name
from loadopt.storage.arrow_outline import Outline, outline_name
from loadopt.storage.conversions import ConvertedForm
from loadopt.storage.convert_engines import ConvertEngine
from loadopt.storage.imagefolder import open_dataset

from .conftest import epoch_inputs, prepared_loader
from .servers import s3_endpoint  # noqa: F401 - a fixture
from .test_remote_conversion import (
    BUCKET,
    s3_config,
    s3_fs,
    s3_images,  # noqa: F401 - a fixture
)

SHARD_MIB = 0.02  # several shards of the 16 photos
ARROW = {"form": "decoded", "shard_mib": SHARD_MIB}


def _form(config) -> ConvertedForm:
    """What the arrow backend reads under the test config (whole frames: augment train)."""
    return conversions.converted_form(config.pipeline, "decoded", None, "auto", False, where="--size")


def _digests_on_s3(folder: str) -> dict[str, str]:
    fs = s3_fs()
    return {path.rsplit("/", 1)[-1]: hashlib.sha256(fs.cat_file(path)).hexdigest()
            for path in sorted(fs.find(folder)) if path.endswith(".arrow")}


def _local_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.arrow"))}


def _local_reference(tmp_path: Path, images: Path):
    """The same photos converted on the local disk (an NFS-like base: the conversion beside them, whole)."""
    config = s3_config(tmp_path, str(images))
    dataset = open_dataset(config)
    return config, dataset, conversions.convert("arrow", dataset, _form(config), SHARD_MIB)


def _remote(tmp_path: Path, s3_images, name: str):  # noqa: F811 - the fixture's value
    url, _, endpoint = s3_images
    home = f"s3://{BUCKET}/arrow-{name}-{tmp_path.name}"
    config = s3_config(tmp_path, url, endpoint, converted=home)
    return config, open_dataset(config), home.removeprefix("s3://") + "/arrow"


def test_an_outline_holds_every_byte_but_the_samples(tmp_path, s3_images):  # noqa: F811
    _, images, _ = s3_images
    _, _, done = _local_reference(tmp_path, images)
    shard = done.path / shard_name(1)
    outline = Outline.of(shard, with_bytes=True)
    outline.save(tmp_path / "x.outline.npz")
    again = Outline.load(tmp_path / "x.outline.npz")
    data = np.frombuffer(shard.read_bytes(), np.uint8)
    image = np.frombuffer(again.image(), np.uint8)[: again.size]
    samples = np.zeros(again.size, bool)
    for at, n in zip(again.offsets.tolist(), again.lengths.tolist(), strict=True):
        samples[at : at + n] = True
    assert again.size == len(data) and samples.any() and len(again.offsets) > 0
    assert np.array_equal(image[~samples], data[~samples])  # everything else in place
    assert not image[samples].any()  # the samples' bytes left to be fetched
    assert again.data is not None and len(again.data) == int((~samples).sum()) < len(data)


def test_the_shards_go_to_s3_and_only_the_outlines_stay_here(own_cache, tmp_path, s3_images):  # noqa: F811
    _, images, _ = s3_images
    _, _, reference = _local_reference(tmp_path, images)
    config, dataset, folder = _remote(tmp_path, s3_images, "local")
    done = conversions.convert("arrow", dataset, _form(config), SHARD_MIB)
    assert done.shards == reference.shards > 2 and not done.reused and done.data_at is not None
    here = sorted(p.name for p in done.path.iterdir())
    assert not any(name.endswith(".arrow") for name in here), here  # the data is on S3 only
    assert "manifest.json" in here and sum(name.endswith(".outline.npz") for name in here) == done.shards
    assert _digests_on_s3(folder) == _local_digests(reference.path)  # the same shards as on the local disk
    assert done.nbytes >= sum(p.stat().st_size for p in reference.path.glob("*.arrow"))
    assert not list((own_cache / "raw").glob(".upload-*"))  # the writers' temporary folders are gone


def test_another_machine_reads_it_from_the_remote_manifest_and_outlines(own_cache, tmp_path, s3_images):  # noqa: F811
    _, images, _ = s3_images
    ref_config, ref_dataset, _ = _local_reference(tmp_path, images)
    expected = epoch_inputs(prepared_loader(ref_config, ref_dataset, "arrow", ARROW))
    config, dataset, _ = _remote(tmp_path, s3_images, "other")
    made = conversions.convert("arrow", dataset, _form(config), SHARD_MIB)
    shutil.rmtree(own_cache)  # a machine that did not convert it: nothing of it on its disk
    loader = prepared_loader(config, open_dataset(config), "arrow", ARROW)
    assert not list(made.path.glob("*.arrow")) and list(made.path.glob("*.outline.npz"))  # the reference, fetched
    assert loader.storage_files() == []
    batches = epoch_inputs(loader)
    assert len(batches) == len(expected) and all(torch.equal(a, b) for a, b in zip(batches, expected, strict=True))
    assert conversions.convert("arrow", open_dataset(config), _form(config), SHARD_MIB).reused


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
    form = _form(config)
    with pytest.raises(KeyboardInterrupt):  # one writer, this process: its uploads are counted here
        arrow_convert.convert(dataset, form.stored, form.size, SHARD_MIB, progress=stop_after_two, workers=1)
    first = list(uploaded)
    uploaded.clear()
    arrow_convert.convert(dataset, form.stored, form.size, SHARD_MIB, workers=1)
    done = conversions.convert("arrow", dataset, form, SHARD_MIB)
    assert len(first) >= 2 and not set(first) & set(uploaded), (first, uploaded)  # the uploaded ones kept
    assert len(first) + len(uploaded) == done.shards


def test_a_damaged_shard_on_s3_is_named_by_the_check(own_cache, tmp_path, s3_images):  # noqa: F811
    config, dataset, folder = _remote(tmp_path, s3_images, "damaged")
    form = _form(config)
    done = conversions.convert("arrow", dataset, form, SHARD_MIB)
    outline = Outline.load(done.path / outline_name(1))
    fs = s3_fs()
    target = next(p for p in fs.find(folder) if p.endswith(f"/{done.path.name}/{shard_name(1)}"))
    data = bytearray(fs.cat_file(target))
    data[int(outline.offsets[0]) + 5] ^= 0xFF  # a byte of the first sample: not in the outline, only on S3
    fs.pipe_file(target, bytes(data))
    with pytest.raises(DatasetError, match=rf"s3://.*{shard_name(1)}: record batch \d+ \(samples .*column") as raised:
        arrow_convert.open_conversion(dataset, form.stored, form.size, SHARD_MIB, verify="all")
    assert "\n" not in str(raised.value)
    arrow_convert.open_conversion(dataset, form.stored, form.size, SHARD_MIB, verify="none")  # opens unchecked


def test_ray_tasks_upload_their_shards_without_the_drivers_folder(own_cache, tmp_path, s3_images):  # noqa: F811
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    _, images, _ = s3_images
    _, _, reference = _local_reference(tmp_path, images)
    config, dataset, folder = _remote(tmp_path, s3_images, "ray")
    elsewhere = tmp_path / "workers-cache"  # the tasks' own disk: the driver's folder is not there
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"LOADOPT_CACHE": str(elsewhere)}})
    try:
        done = conversions.convert("arrow", dataset, _form(config), SHARD_MIB, engine=ConvertEngine("ray"))
    finally:
        ray.shutdown()
    assert _digests_on_s3(folder) == _local_digests(reference.path)
    assert not list(done.path.glob("*.arrow"))
    assert not list((elsewhere / "raw").glob(".upload-*"))  # each task's temporary folder removed


def test_storage_converted_moved_converts_at_the_new_home_and_leaves_the_old(own_cache, tmp_path, s3_images,  # noqa: F811
                                                                            caplog):
    config, dataset, first = _remote(tmp_path, s3_images, "first")
    form = _form(config)
    conversions.convert("arrow", dataset, form, SHARD_MIB)
    kept = _digests_on_s3(first)
    moved_config, moved, second = _remote(tmp_path, s3_images, "second")  # the same local reference, a new home
    # opened without converting (bench --no-convert): one line naming the new home and the remedy
    with pytest.raises(DatasetError, match=r"whose shards are not at s3://.*arrow-second.*changed since.*"
                                           r"loadopt convert CONFIG --to arrow") as raised:
        arrow_convert.open_conversion(moved, form.stored, form.size, SHARD_MIB)
    assert "\n" not in str(raised.value)
    with caplog.at_level("WARNING"):
        again = conversions.convert("arrow", moved, form, SHARD_MIB)
    assert "storage.converted changed since): converting there" in caplog.text
    assert not again.reused and again.data_at is not None and "arrow-second" in again.data_at
    assert _digests_on_s3(second) == kept  # the same shards at the new home
    assert _digests_on_s3(first) == kept  # and the old home's left as it was
    expected = epoch_inputs(prepared_loader(config, open_dataset(config), "arrow", ARROW))
    batches = epoch_inputs(prepared_loader(moved_config, open_dataset(moved_config), "arrow", ARROW))
    assert len(batches) == len(expected) and all(torch.equal(a, b) for a, b in zip(batches, expected, strict=True))
