"""The Arrow form as shards and a manifest: many shards deliver what one does (mapped, and through a tier), a
conversion stopped part way resumes from its finished shards into the same bytes, and a shard that is missing
is one line naming it and its samples."""

import json

import pytest
import torch

from loadopt.errors import DatasetError
from loadopt.loaders.arrow.loader import ArrowLoader, ArrowSettings
from loadopt.storage.forms import arrow_convert, arrow_format, shard_work
from loadopt.storage.open import open_dataset

from .conftest import epoch_inputs, prepared_loader
from .test_arrow import assert_same, batches, config
from .test_tier_backends import FAST_TIER, _config

TINY_MIB = 0.02  # a shard closes after about 20 KB: a few record batches of 8 rows each


@pytest.fixture
def small_batches(monkeypatch):
    """Record batches of 8 rows, so the tiny dataset spans several record batches and shards."""
    monkeypatch.setattr(arrow_format, "ROWS_PER_BATCH", 8)


@pytest.mark.parametrize(("form", "augment"), [("decoded", "eval"), ("decoded", "train"), ("encoded", "eval")])
def test_many_shards_deliver_what_one_shard_does(tmp_path, small_batches, form, augment):
    cfg = config(tmp_path, augment=augment)
    dataset = open_dataset(cfg)
    one = ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form=form), seed=4)
    many = ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form=form, shard_mib=TINY_MIB), seed=4)
    reference, sharded = batches(one), batches(many)
    files = many.storage_files()
    assert len(files) > 2 and all(f.endswith(".arrow") for f in files) and len(one.storage_files()) == 1
    meta = shard_work.read_manifest(arrow_format.arrow_path(dataset, many.stored_form, many.size, TINY_MIB),
                                    "Arrow conversion")
    assert sum(e["samples"] for e in meta["shard_table"]) == len(dataset)
    assert [e["first"] for e in meta["shard_table"]][1:] == \
        [e["first"] + e["samples"] for e in meta["shard_table"]][:-1]
    assert_same(sharded, reference)


@pytest.mark.parametrize(("backend", "settings"), [("arrow", {"form": "decoded", "shard_mib": TINY_MIB}),
                                                   ("arrow", {"form": "encoded", "shard_mib": TINY_MIB}),
                                                   ("dali", {"num_threads": 1, "source": "arrow"})])
def test_sharded_conversions_read_through_a_tier_equal_the_local_disk(tmp_path, small_batches, backend, settings):
    tiered_config = _config(tmp_path, FAST_TIER)
    tiered = epoch_inputs(prepared_loader(tiered_config, open_dataset(tiered_config), backend, settings))
    local_config = _config(tmp_path, "local")
    local = epoch_inputs(prepared_loader(local_config, open_dataset(local_config), backend, settings))
    assert len(local) == len(tiered) and all(torch.equal(a, b) for a, b in zip(local, tiered, strict=True))


def test_an_interrupted_conversion_resumes_from_its_finished_shards(tmp_path, small_batches, monkeypatch):
    cfg = config(tmp_path)
    dataset = open_dataset(cfg)
    real = arrow_convert.record_batches
    asked: list[int] = []
    made = [0]  # record batches made, over every shard

    def dies(*args):
        for batch in real(*args):
            made[0] += 1
            if made[0] == 5:
                raise KeyboardInterrupt
            yield batch

    def counted(*args):
        asked.append(args[-2])  # the first sample converted (then the end)
        yield from real(*args)

    monkeypatch.setattr(arrow_convert, "record_batches", dies)
    with pytest.raises(KeyboardInterrupt):
        arrow_convert.convert(dataset, "decoded", 41, TINY_MIB, workers=1)
    final = arrow_format.arrow_path(dataset, "decoded", 41, TINY_MIB)
    work = shard_work.work_folder(final)
    finished = sorted(work.glob("shard-*.json"))
    assert not final.exists() and finished and not (work / shard_work.MANIFEST).exists()
    assert not list(work.glob(".*.tmp"))  # the shard being written was abandoned
    entries = [json.loads(p.read_text()) for p in finished]
    monkeypatch.setattr(arrow_convert, "record_batches", counted)
    assert arrow_convert.convert(dataset, "decoded", 41, TINY_MIB, workers=1) == final
    converted = entries[-1]["first"] + entries[-1]["samples"]
    table = shard_work.read_manifest(final, "Arrow conversion")["shard_table"]
    # the shards not finished, each converted once (one call a shard), the finished ones never again
    assert asked == [e["first"] for e in table[len(entries):]] and 0 < converted == asked[0] <= 32
    assert not work.exists()
    resumed = arrow_format.open_arrow(final, dataset, "decoded", 41, TINY_MIB, verify_labels=True, verify="all")
    rows = [bytes(b.column(2).buffers()[1])[: b.num_rows * 41 * 41 * 3] for b in resumed]
    arrow_convert.convert(dataset, "decoded", 41, TINY_MIB, workers=1, force=True)
    fresh = arrow_format.open_arrow(final, dataset, "decoded", 41, TINY_MIB, verify="all")
    assert rows == [bytes(b.column(2).buffers()[1])[: b.num_rows * 41 * 41 * 3] for b in fresh]


def test_a_missing_shard_is_one_line_naming_it_and_its_samples(tmp_path, small_batches):
    cfg = config(tmp_path)
    dataset = open_dataset(cfg)
    folder = arrow_convert.convert(dataset, "encoded", None, TINY_MIB, workers=1)
    table = shard_work.read_manifest(folder, "Arrow conversion")["shard_table"]
    assert len(table) > 2
    gone = folder / arrow_format.shard_name(1)
    gone.unlink()
    first, last = table[1]["first"], table[1]["first"] + table[1]["samples"] - 1
    with pytest.raises(DatasetError, match=f"{gone}: Arrow shard not found \\(the manifest lists it: samples "
                                           f"{first}-{last}\\)"):
        arrow_format.open_arrow(folder, dataset, "encoded", None, TINY_MIB)
