"""A raw or Arrow conversion whose home is S3 (moto's server on loopback; storage/remote/converted.py): each shard's
data is uploaded by whichever process or Ray task wrote it, only the reference (manifest, entries, and the raw
index rows or the Arrow outlines: storage/forms/arrow_outline.py) stays on the local disk, another machine opens it from
the remote manifest and reference alone, a stopped conversion resumes from the shards already uploaded (a killed
writer's temporary upload removed there), a damaged remote shard is named by the check, and a moved
`storage.converted` converts at the new home. The data is byte for byte that of the same conversion made on the
local disk, and the batches read through the tier are the same."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from loadopt.errors import DatasetError
from loadopt.storage.forms import arrow_convert, arrow_format, conversions, raw_convert, raw_format
from loadopt.storage.forms.arrow_outline import Outline, outline_name
from loadopt.storage.forms.conversions import Conversion, ConvertedForm
from loadopt.storage.forms.engine import ConvertEngine
from loadopt.storage.open import open_dataset
from loadopt.storage.remote import converted as remote_shards

from .conftest import epoch_inputs, prepared_loader
from .servers import s3_endpoint  # noqa: F401 - a fixture
from .test_remote_conversion import (
    BUCKET,
    s3_config,
    s3_fs,
    s3_images,  # noqa: F401 - a fixture
)

SHARD_MIB = 0.02  # several shards of the 16 photos


def _first_sample_byte(done: Conversion, k: int) -> int:
    """A byte of shard `k`'s first sample: in an Arrow shard, one not in its outline (only on S3)."""
    return int(Outline.load(done.path / outline_name(k)).offsets[0]) + 5


@dataclass(frozen=True)
class RemoteForm:
    """What differs between the two converted forms here: names, the files that stay, how damage is named."""
    to: str  # raw | arrow
    backend: str  # the loader that reads it
    module: ModuleType  # its conversion module (convert, open_conversion)
    shard_name: Callable[[int], str]
    data_suffixes: tuple[str, ...]  # the files compared byte for byte with the local conversion's
    reference_suffix: str  # one per shard, kept on the local disk
    damaged_at: Callable[[Conversion, int], int]  # which byte of shard k the damage test flips
    damage_named: str  # the check's message about it


FORMS = [
    RemoteForm("raw", "posix", raw_convert, raw_format.shard_name, (".bin", ".npy"), ".idx.npy",
               lambda done, k: 100, r"chunk 0"),
    RemoteForm("arrow", "arrow", arrow_convert, arrow_format.shard_name, (".arrow",), ".outline.npz",
               _first_sample_byte, r"record batch \d+ \(samples .*column"),
]


@pytest.fixture(params=FORMS, ids=lambda form: form.to)
def form_(request) -> RemoteForm:
    return request.param


def _stored(config) -> ConvertedForm:
    """What the posix and arrow backends read under the test config (whole frames: augment train)."""
    return conversions.converted_form(config.pipeline, "decoded", None, "auto", False, where="--size")


def _options() -> dict:
    return {"form": "decoded", "shard_mib": SHARD_MIB}


def _digests_on_s3(folder: str, form: RemoteForm) -> dict[str, str]:
    fs = s3_fs()
    return {path.rsplit("/", 1)[-1]: hashlib.sha256(fs.cat_file(path)).hexdigest()
            for path in sorted(fs.find(folder)) if path.endswith(form.data_suffixes)}


def _local_digests(folder: Path, form: RemoteForm) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.name.endswith(form.data_suffixes)}


def _local_reference(tmp_path: Path, images: Path, form: RemoteForm):
    """The same photos converted on the local disk (an NFS-like base: the conversion beside them, whole)."""
    config = s3_config(tmp_path, str(images))
    dataset = open_dataset(config)
    return config, dataset, conversions.convert(form.to, dataset, _stored(config), SHARD_MIB)


def _remote(tmp_path: Path, s3_images, name: str, form: RemoteForm):  # noqa: F811 - the fixture's value
    url, _, endpoint = s3_images
    home = f"s3://{BUCKET}/{form.to}-{name}-{tmp_path.name}"
    config = s3_config(tmp_path, url, endpoint, converted=home)
    return config, open_dataset(config), home.removeprefix("s3://") + "/" + form.to


def _same_batches(got: list, expected: list) -> bool:
    return len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_an_outline_holds_every_byte_but_the_samples(tmp_path, s3_images):  # noqa: F811
    _, images, _ = s3_images
    _, _, done = _local_reference(tmp_path, images, FORMS[1])
    shard = done.path / arrow_format.shard_name(1)
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


def test_the_shards_go_to_s3_and_only_the_reference_stays_here(own_cache, tmp_path, s3_images,  # noqa: F811
                                                               form_):
    _, images, _ = s3_images
    _, _, reference = _local_reference(tmp_path, images, form_)
    config, dataset, folder = _remote(tmp_path, s3_images, "local", form_)
    done = conversions.convert(form_.to, dataset, _stored(config), SHARD_MIB)
    assert done.shards == reference.shards > 2 and not done.reused and done.data_at is not None
    here = sorted(p.name for p in done.path.iterdir())
    assert not any(name == form_.shard_name(k) for name in here for k in range(done.shards)), here  # on S3 only
    assert "manifest.json" in here and sum(name.endswith(form_.reference_suffix) for name in here) == done.shards
    assert _digests_on_s3(folder, form_) == _local_digests(reference.path, form_)  # the same as on the local disk
    assert done.nbytes >= sum((reference.path / form_.shard_name(k)).stat().st_size for k in range(done.shards))
    assert not list((own_cache / "raw").glob(".upload-*"))  # the writers' temporary folders are gone


def test_another_machine_reads_it_from_the_remote_manifest_and_reference(
        own_cache, tmp_path, s3_images, form_):  # noqa: F811
    _, images, _ = s3_images
    ref_config, ref_dataset, _ = _local_reference(tmp_path, images, form_)
    expected = epoch_inputs(prepared_loader(ref_config, ref_dataset, form_.backend, _options()))
    config, dataset, _ = _remote(tmp_path, s3_images, "other", form_)
    made = conversions.convert(form_.to, dataset, _stored(config), SHARD_MIB)
    shutil.rmtree(own_cache)  # a machine that did not convert it: nothing of it on its disk
    loader = prepared_loader(config, open_dataset(config), form_.backend, _options())
    assert not (made.path / form_.shard_name(0)).exists()  # the reference only, fetched
    assert (made.path / "manifest.json").exists() and list(made.path.glob("*" + form_.reference_suffix))
    assert loader.storage_files() == []
    assert _same_batches(epoch_inputs(loader), expected)
    assert conversions.convert(form_.to, open_dataset(config), _stored(config), SHARD_MIB).reused


def test_a_stopped_conversion_resumes_from_the_shards_already_on_s3(own_cache, tmp_path, s3_images,  # noqa: F811
                                                                   monkeypatch, form_):
    config, dataset, folder = _remote(tmp_path, s3_images, "resume", form_)
    uploaded: list[str] = []
    upload = remote_shards.RemoteShards.upload

    def counted(self, local, name):
        upload(self, local, name)
        uploaded.append(name)

    def stop_after_two(done: int, total: int) -> None:
        if len(uploaded) >= 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(remote_shards.RemoteShards, "upload", counted)
    stored = _stored(config)
    with pytest.raises(KeyboardInterrupt):  # one writer, this process: its uploads are counted here
        form_.module.convert(dataset, stored.stored, stored.size, SHARD_MIB, progress=stop_after_two, workers=1)
    first = list(uploaded)
    uploaded.clear()
    fs = s3_fs()
    shard = next(p for p in fs.find(folder) if p.endswith("/" + first[0]))
    # what a writer killed between its upload and the rename leaves (another host's: its pid means nothing here)
    leftover = shard.rsplit("/", 1)[0] + f"/.{form_.shard_name(7)}.another-node.4242.0badcafe.tmp"
    fs.pipe_file(leftover, b"half a shard")
    form_.module.convert(dataset, stored.stored, stored.size, SHARD_MIB, workers=1)
    done = conversions.convert(form_.to, dataset, stored, SHARD_MIB)
    assert len(first) >= 2 and not set(first) & set(uploaded), (first, uploaded)  # the uploaded ones kept
    assert len(first) + len(uploaded) == done.shards
    assert not fs.exists(leftover)  # removed once every shard was there, before the manifest


def test_a_damaged_shard_on_s3_is_named_by_the_check(own_cache, tmp_path, s3_images, form_):  # noqa: F811
    config, dataset, folder = _remote(tmp_path, s3_images, "damaged", form_)
    stored = _stored(config)
    done = conversions.convert(form_.to, dataset, stored, SHARD_MIB)
    fs = s3_fs()
    target = next(p for p in fs.find(folder) if p.endswith(f"/{done.path.name}/{form_.shard_name(1)}"))
    data = bytearray(fs.cat_file(target))
    data[form_.damaged_at(done, 1)] ^= 0xFF
    fs.pipe_file(target, bytes(data))
    with pytest.raises(DatasetError, match=rf"s3://.*{form_.shard_name(1)}: {form_.damage_named}") as raised:
        form_.module.open_conversion(dataset, stored.stored, stored.size, SHARD_MIB, verify="all")
    assert "\n" not in str(raised.value)
    form_.module.open_conversion(dataset, stored.stored, stored.size, SHARD_MIB, verify="none")  # opens unchecked


def test_ray_tasks_upload_their_shards_without_the_drivers_folder(own_cache, tmp_path, s3_images,  # noqa: F811
                                                                  form_):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    _, images, _ = s3_images
    _, _, reference = _local_reference(tmp_path, images, form_)
    config, dataset, folder = _remote(tmp_path, s3_images, "ray", form_)
    elsewhere = tmp_path / "workers-cache"  # the tasks' own disk: the driver's folder is not there
    # "local": a cluster of its own, not another test run's that ray.init() would join on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"LOADOPT_CACHE": str(elsewhere)}})
    try:
        done = conversions.convert(form_.to, dataset, _stored(config), SHARD_MIB, engine=ConvertEngine("ray"))
    finally:
        ray.shutdown()
    assert _digests_on_s3(folder, form_) == _local_digests(reference.path, form_)
    assert not (done.path / form_.shard_name(0)).exists()
    assert not list((elsewhere / "raw").glob(".upload-*"))  # each task's temporary folder removed


def test_storage_converted_moved_converts_at_the_new_home_and_leaves_the_old(
        own_cache, tmp_path, s3_images, caplog, form_):  # noqa: F811
    config, dataset, first = _remote(tmp_path, s3_images, "first", form_)
    stored = _stored(config)
    conversions.convert(form_.to, dataset, stored, SHARD_MIB)
    kept = _digests_on_s3(first, form_)
    moved_config, moved, second = _remote(tmp_path, s3_images, "second", form_)  # the same reference, a new home
    # opened without converting (bench --no-convert): one line naming the new home and the remedy
    with pytest.raises(DatasetError, match=rf"whose shards are not at s3://.*{form_.to}-second.*changed since.*"
                                           rf"loadopt convert CONFIG --to {form_.to}") as raised:
        form_.module.open_conversion(moved, stored.stored, stored.size, SHARD_MIB)
    assert "\n" not in str(raised.value)
    with caplog.at_level("WARNING"):
        again = conversions.convert(form_.to, moved, stored, SHARD_MIB)
    assert "storage.converted changed since): converting there" in caplog.text
    assert not again.reused and again.data_at is not None and f"{form_.to}-second" in again.data_at
    assert _digests_on_s3(second, form_) == kept  # the same shards at the new home
    assert _digests_on_s3(first, form_) == kept  # and the old home's left as it was
    expected = epoch_inputs(prepared_loader(config, open_dataset(config), form_.backend, _options()))
    batches = epoch_inputs(prepared_loader(moved_config, open_dataset(moved_config), form_.backend, _options()))
    assert _same_batches(batches, expected)
