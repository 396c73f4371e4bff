"""The job's own sources: a Hugging Face dataset (in memory, `save_to_disk`), tar shards written by `webdataset`
and Parquet written by `datasets`, their fields (captions, JSON targets, columns) on every path, and a field some
samples lack."""

import numpy as np
import pytest
import torch

from loadopt import make_loader
from loadopt.errors import ConfigError, DatasetError

from .own_job import assert_same, epoch_of, hugging_face_captioned, own_augment, own_data


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return own_data.write_folder(tmp_path_factory.mktemp("own") / "data", count=40)


def test_a_hugging_face_dataset_with_image_and_class_label_features(tmp_path, folder):
    datasets = pytest.importorskip("datasets")
    own = own_data.CaptionedJpegs(folder)
    hf = hugging_face_captioned(own)
    common = {"batch_size": 8, "image_size": 48, "shuffle": True, "seed": 1, "dtype": "uint8",
              "transform": own_augment.train}
    reference = epoch_of(make_loader(own_data.CaptionedSamples(folder), backend="torch", num_workers=0, **common))
    saved = tmp_path / "saved"
    hf.save_to_disk(str(saved))
    for name, given in [("in memory", hf), ("save_to_disk folder", datasets.load_from_disk(str(saved)))]:
        for backend, settings in [("torch", {"num_workers": 2}), ("arrow", {"form": "encoded"}), ("dali", {})]:
            loader = make_loader(given, backend=backend, **settings, **common)
            assert loader.dataset.classes == own.classes
            assert_same(reference, epoch_of(loader), f"{name} on {backend}")


class SomeWithoutCaptions(own_data.CaptionedSamples):
    def __getitem__(self, index):
        item = super().__getitem__(index)
        if index % 10 == 7:
            del item["caption"]
        return item


def test_a_field_missing_from_some_samples_is_one_line_or_skipped_and_counted(folder):
    dataset = SomeWithoutCaptions(folder)
    with pytest.raises(DatasetError, match=r"^python:(tests\.)?test_own_sources.SomeWithoutCaptions\[7\]: no field "
                                           r"'caption' \(the first item has it\) \(set dataset.on_error: skip to skip "
                                           r"it\)$"):
        make_loader(dataset, backend="torch", batch_size=8, image_size=32)
    for backend in ("torch", "posix"):
        loader = make_loader(dataset, backend=backend, batch_size=8, image_size=32, on_error="skip", form="encoded") \
            if backend == "posix" else make_loader(dataset, backend=backend, batch_size=8, image_size=32,
                                                   on_error="skip", num_workers=0)
        batches = epoch_of(loader)
        assert sum(len(batch[1]) for batch in batches) == len(dataset) - 4
        assert sorted(path.rsplit("[", 1)[1] for path, _ in loader.counters.skipped) == ["17]", "27]", "37]", "7]"]


def test_a_field_the_dataset_lacks_is_one_line(folder):
    with pytest.raises(ConfigError, match=r"pipeline.fields: python:own_data.CaptionedSamples has no field 'boxes' "
                                          r"\(its fields: caption\)"):
        make_loader(own_data.CaptionedSamples(folder), backend="torch", fields=["boxes"])
    loader = make_loader(own_data.CaptionedSamples(folder), backend="torch", fields=[], num_workers=0, batch_size=8)
    assert all(len(batch) == 2 for batch in epoch_of(loader))  # fields: [] carries none


def test_a_webdataset_with_txt_captions_delivers_them(tmp_path):
    """Tar shards as `webdataset.TarWriter` writes them (a `jpg`, a `cls`, a `txt` caption and a `json` target per
    sample, one sample without its `json`): the captions and targets reach the batch on every path, in order."""
    import io

    webdataset = pytest.importorskip("webdataset")
    from PIL import Image

    rng = np.random.default_rng(0)
    (tmp_path / "train").mkdir()
    for shard in range(2):
        with webdataset.TarWriter(str(tmp_path / "train" / f"shard-{shard:04d}.tar")) as sink:
            for i in range(20):
                n = shard * 20 + i
                jpeg = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (40 + n, 50, 3), dtype=np.uint8)).save(jpeg, format="JPEG")
                sample = {"__key__": f"s{n:05d}", "jpg": jpeg.getvalue(), "cls": str(n % 3), "txt": f"caption {n}",
                          "json": {"boxes": [[1, 2, 3, n]]}}
                if n == 13:
                    del sample["json"]
                sink.write(sample)
    config = {"dataset": {"path": str(tmp_path), "format": "webdataset"},
              "pipeline": {"batch_size": 8, "image_size": 32, "shuffle": True, "dtype": "uint8"}}
    epochs = {}
    for backend, settings in [("torch", {"num_workers": 2}), ("arrow", {"form": "encoded"}),
                              ("posix", {"form": "encoded"}), ("dali", {})]:
        loader = make_loader(config, backend=backend, **settings)
        assert loader.field_names == ["txt"]  # every sample has one; `json` only some
        epochs[backend] = epoch_of(loader)
        if backend == "dali":  # its own decoder and resize kernel (no job transform here): other pixels
            epochs[backend] = [(reference[0], *batch[1:]) for reference, batch in zip(epochs["torch"],
                                                                                      epochs[backend], strict=True)]
        assert_same(epochs["torch"], epochs[backend], f"{backend} against torch")
    labels = torch.cat([batch[1] for batch in epochs["torch"]]).tolist()
    captions = [caption for batch in epochs["torch"] for caption in batch[2]["txt"]]
    assert sorted(captions) == sorted(f"caption {n}" for n in range(40))
    assert all(int(caption.split()[1]) % 3 == label for caption, label in zip(captions, labels, strict=True))
    with pytest.raises(DatasetError, match=r"shard-0000.tar \(sample s00013, bytes \d+-\d+\): no `json` member "
                                           r"\(pipeline.fields names it\) \(set dataset.on_error: skip to skip it\)"):
        make_loader(config, backend="torch", fields=["txt", "json"])
    loader = make_loader(config, backend="torch", num_workers=0, fields=["txt", "json"], on_error="skip")
    batches = epoch_of(loader)
    assert sum(len(batch[1]) for batch in batches) == 39 and len(loader.counters.skipped) == 1
    boxes = [target["boxes"][0][3] for batch in batches for target in batch[2]["json"]]
    captions = [int(caption.split()[1]) for batch in batches for caption in batch[2]["txt"]]
    assert boxes == captions  # each target is its own sample's


def test_parquet_written_by_hugging_face_with_its_images_by_path(tmp_path):
    """`datasets`' `to_parquet` of images loaded from local files writes each cell's path, not its bytes: the images
    are read from those files, the extra columns reach the batch, and a changed image file changes the fingerprint
    and what every path delivers (the incremental conversion does not reuse the stale shard)."""
    pytest.importorskip("datasets")
    from PIL import Image

    split = own_data.write_folder(tmp_path / "images", count=24)
    own = own_data.CaptionedJpegs(split)
    hf = hugging_face_captioned(own)
    (tmp_path / "pq" / "data").mkdir(parents=True)
    hf.to_parquet(str(tmp_path / "pq" / "data" / "train-00000-of-00001.parquet"))
    config = {"dataset": {"path": str(tmp_path / "pq"), "format": "parquet"},
              "pipeline": {"batch_size": 8, "image_size": 32, "shuffle": False, "dtype": "uint8"}}

    def epochs():
        return {backend: epoch_of(make_loader(config, backend=backend, **settings))
                for backend, settings in [("torch", {"num_workers": 0}), ("arrow", {"form": "encoded"})]}

    before = epochs()
    assert_same(before["torch"], before["arrow"], "arrow against torch")
    assert [c for batch in before["torch"] for c in batch[2]["caption"]] == [own.caption(i) for i in range(24)]
    fingerprint = make_loader(config, backend="torch").dataset.fingerprint
    Image.new("RGB", (50, 50), (200, 0, 0)).save(own.files[0][0], quality=90)
    after = epochs()
    assert make_loader(config, backend="torch").dataset.fingerprint != fingerprint
    assert_same(after["torch"], after["arrow"], "arrow against torch, the image changed")
    assert not torch.equal(after["arrow"][0][0][0], before["arrow"][0][0][0])
    assert torch.equal(after["arrow"][0][0][1:], before["arrow"][0][0][1:])


def test_a_save_to_disk_folder_is_a_dataset_path(folder, tmp_path):
    """A Hugging Face `save_to_disk` folder, named as `dataset.path` or handed to `make_loader` as a folder (a
    DatasetDict's split by `split`), is read as the dataset it holds, with its class names and columns."""
    datasets = pytest.importorskip("datasets")
    own = own_data.CaptionedJpegs(folder)
    hf = hugging_face_captioned(own)
    datasets.DatasetDict({"train": hf, "validation": hf.select(range(8))}).save_to_disk(str(tmp_path / "saved"))
    reference = epoch_of(make_loader(hf, backend="torch", num_workers=0, batch_size=8, shuffle=False))
    config = {"dataset": {"path": str(tmp_path / "saved")}, "pipeline": {"batch_size": 8, "shuffle": False}}
    for given in (config, str(tmp_path / "saved")):
        loader = make_loader(given, backend="arrow", form="encoded", batch_size=8, shuffle=False)
        assert loader.dataset.classes == own.classes
        assert_same(reference, epoch_of(loader), f"{given!r} on arrow")
    assert len(make_loader(str(tmp_path / "saved"), "validation", backend="torch", num_workers=0).dataset) == 8
    with pytest.raises(DatasetError, match=r"saved: no split 'test' \(its splits: train, validation\)"):
        make_loader(str(tmp_path / "saved"), "test", backend="torch")


@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "no-ranges"])
def test_the_fields_of_a_served_dataset_reach_the_batch_as_they_do_from_disk(tmp_path, own_cache, ranges):
    """Parquet with a caption column and tar shards with a JSON member, read over HTTP (from a server that answers
    byte ranges, and from one that answers every request with the whole file): the same fields, in the same
    order, as from the local copy."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .shaped_server import shaped_server
    from .source_files import folder_samples, write_parquet, write_shards

    own_data.write_folder(tmp_path / "images", count=12, classes=3)
    samples = folder_samples(tmp_path / "images" / "train")
    site = tmp_path / "site"
    for path in write_parquet(site / "pq", samples, ["c0", "c1", "c2"]):
        table = pq.read_table(path)
        captions = [f"caption of {image['path']}" for image in table.column("image").to_pylist()]
        pq.write_table(table.append_column("caption", pa.array(captions)), path, row_group_size=3)
    write_shards(site / "shards", samples, per_shard=5, labels_in="json")
    server = shaped_server(site)
    if not ranges:
        server.without_ranges()
    pipeline = {"batch_size": 4, "image_size": 32, "shuffle": True, "dtype": "uint8"}
    try:
        for form, folder, field in [("parquet", "pq", "caption"), ("webdataset", "shards", "json")]:
            for backend, settings in [("torch", {"num_workers": 0}), ("arrow", {"form": "encoded"})]:
                keys = {"label_key": "target"} if form == "webdataset" else {}
                local, served = ({"dataset": {"path": where, "format": form, **keys}, "pipeline": pipeline}
                                 for where in (str(site / folder), f"{server.url}/{folder}"))
                from_disk = epoch_of(make_loader(local, backend=backend, **settings))
                over_http = epoch_of(make_loader(served, backend=backend, **settings))
                assert all(field in batch[2] for batch in over_http), f"{form} on {backend}: no {field}"
                assert_same(from_disk, over_http, f"{form} on {backend}, served against from disk")
                assert sum(len(batch[2][field]) for batch in over_http) == len(samples)
    finally:
        server.die()
