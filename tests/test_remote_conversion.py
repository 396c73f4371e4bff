"""A dataset on S3 (moto's server on loopback): its arrow and posix conversions are written to S3 beside
the source (`<root>/.loadopt/`, or `storage.converted`), read back through the tier (its counters see the
bytes), and give the same batches as the same images converted on the local disk."""

from __future__ import annotations

import pytest
import torch

from loadopt.config import config_from_dict
from loadopt.storage.open import open_dataset
from loadopt.storage.tiers.stack import tier_counters

from .conftest import epoch_inputs, make_image_folder, prepared_loader, tiny_config_dict
from .servers import s3_endpoint  # noqa: F401 - a fixture

BUCKET = "loadopt-conversions"
# (backend, settings): the decoded forms (whole frames under augment: train) and arrow's encoded one
SETTINGS = [("arrow", {"form": "decoded"}), ("arrow", {"form": "encoded"}),
            ("posix", {"form": "decoded", "shard_mib": 0.25})]


@pytest.fixture(scope="module")
def s3_images(s3_endpoint, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """(the dataset's S3 URL, the same ImageFolder on the local disk, the endpoint)."""
    import s3fs

    local = tmp_path_factory.mktemp("s3-conversion-source")
    make_image_folder(local, classes=2, per_class=8)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists(BUCKET):  # made by the other module using this fixture
        fs.mkdir(BUCKET)
    fs.put(f"{local}/", f"{BUCKET}/images/", recursive=True)
    return f"s3://{BUCKET}/images", local, s3_endpoint


def s3_config(tmp_path, base: str, endpoint: str | None = None, **storage):
    tier = {"name": "moto" if endpoint else "nfs", "base": base}
    if endpoint:
        tier["storage_options"] = {"endpoint_url": endpoint, "key": "testing", "secret": "testing-secret"}
    raw = tiny_config_dict(tmp_path / "results", storage={"tier": tier, **storage},
                           pipeline={"batch_size": 4, "image_size": 24, "augment": "train"})
    return config_from_dict(raw, "s3.yaml")


def s3_fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


@pytest.mark.parametrize(("backend", "settings"), SETTINGS, ids=[f"{b}-{s['form']}" for b, s in SETTINGS])
def test_a_conversion_of_an_s3_dataset_is_written_to_s3_and_read_back_through_the_tier(tmp_path, s3_images,
                                                                                      backend, settings):
    url, local, endpoint = s3_images
    config = s3_config(tmp_path, url, endpoint)
    dataset = open_dataset(config)
    assert dataset.converted == f"{url}/train/.loadopt"
    loader = prepared_loader(config, dataset, backend, settings)
    names = {path.rsplit("/", 1)[-1] for path in s3_fs().find(f"{BUCKET}/images/train/.loadopt")}
    if backend == "posix":  # the index (written last) and its shards, beside any other form's
        assert "manifest.json" in names, names
        assert any(n.startswith("shard-") for n in names), names
    else:
        assert any(n.endswith(".arrow") for n in names), names
    assert loader.storage_files() == []  # nothing on the local disk: every byte comes from S3
    before = tier_counters(dataset.fs)
    batches = epoch_inputs(loader)
    after = tier_counters(dataset.fs)
    assert len(batches) == 4 and loader.counters.bytes_read > 0
    assert after["bytes"] - before["bytes"] >= 0.95 * loader.counters.bytes_read
    assert after["requests"] > before["requests"]
    # The same images converted on the local disk (an NFS-like base: conversions beside them) give the
    # same batches: the conversion on S3 is the same conversion.
    reference_config = s3_config(tmp_path, str(local))
    reference = epoch_inputs(prepared_loader(reference_config, open_dataset(reference_config), backend, settings))
    assert all(torch.equal(a, b) for a, b in zip(batches, reference, strict=True))


def test_storage_converted_puts_an_s3_datasets_conversion_elsewhere_on_s3(tmp_path, s3_images):
    url, _, endpoint = s3_images
    elsewhere = f"s3://{BUCKET}/conversions-{tmp_path.name}"
    config = s3_config(tmp_path, url, endpoint, converted=elsewhere)
    dataset = open_dataset(config)
    batches = epoch_inputs(prepared_loader(config, dataset, "arrow", {"form": "encoded"}))
    assert len(batches) == 4
    assert any(path.endswith(".arrow") for path in s3_fs().find(elsewhere.removeprefix("s3://")))
