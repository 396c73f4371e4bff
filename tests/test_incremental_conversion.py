"""A changed source shard reconverts only its own shards: the conversion of the changed dataset keeps every
shard of the earlier one whose source shards did not change (linked, at its samples' new place), converts only
the rest, and holds exactly what a conversion from scratch holds."""

import os

import numpy as np
import pytest

from loadopt.storage.forms import arrow_convert, arrow_format, conversions, raw_convert, raw_format, shard_work
from loadopt.storage.forms.conversions import ConvertedForm
from loadopt.storage.open import open_dataset

from .conftest import make_image_folder
from .source_files import folder_samples, write_shards
from .test_sources import _config

FORM = ConvertedForm("decoded", "centre", "decoded", 40)
PER_TAR = 8
SHARD_MIB = {"raw": 0.03, "arrow": 0.02}  # 4 samples (of 4,800 bytes; raw: 8 KiB aligned) a shard: a tar is 2


def _stored(to: str, path, dataset) -> list[bytes]:
    """Each sample's stored bytes, in order."""
    if to == "raw":
        raw = raw_format.open_raw(path, dataset, FORM.stored, FORM.size, SHARD_MIB[to], verify="all")
        shard, offset, length = raw.locate(np.arange(len(dataset)))
        out = []
        for k, at, n in zip(shard.tolist(), offset.tolist(), length.tolist(), strict=True):
            with open(raw.shards[k], "rb") as handle:
                handle.seek(at)
                out.append(handle.read(n))
        return out
    batches = arrow_format.open_arrow(path, dataset, FORM.stored, FORM.size, SHARD_MIB[to], verify_labels=True,
                                      verify="all")
    return [value.as_py() for b in batches for value in b.column(2)]


@pytest.mark.parametrize("to", ["raw", "arrow"])
@pytest.mark.parametrize("change", ["bytes", "count"])
def test_a_changed_source_shard_reconverts_only_its_own_shards(tmp_path, own_cache, monkeypatch, to, change):
    monkeypatch.setattr(arrow_format, "ROWS_PER_BATCH", 4)
    make_image_folder(tmp_path / "folder", classes=3, per_class=16)
    samples = folder_samples(tmp_path / "folder")
    shards = tmp_path / "shards"
    write_shards(shards / "train", samples, per_shard=PER_TAR)
    config = _config(tmp_path, str(shards))
    before = open_dataset(config)
    first = conversions.convert(to, before, FORM, SHARD_MIB[to])
    table = shard_work.read_manifest(first.path, to)["shard_table"]
    assert len(table) == len(before) // 4

    # tar 2 changes: one image replaced by another's bytes, or one sample gone (every later one moves back one)
    changed = samples[2 * PER_TAR : 3 * PER_TAR]
    changed = [(changed[0][0], changed[0][1], samples[0][2])] + changed[1:] if change == "bytes" else changed[1:]
    tar = shards / "train" / "train-000002.tar"
    write_shards(tmp_path / "new", changed, per_shard=PER_TAR)
    os.replace(tmp_path / "new" / "train-000000.tar", tar)
    after = open_dataset(config)
    assert after.fingerprint != before.fingerprint and len(after) == len(before) - (change == "count")

    module, name = (raw_convert, "samples") if to == "raw" else (arrow_convert, "record_batches")
    real, ranges = getattr(module, name), tmp_path / "converted.txt"

    def counted(*args):  # (start, stop) of each range converted from the source, by whichever process writes it
        with open(ranges, "a") as out:
            out.write(f"{args[-2]} {args[-1]}\n")
        yield from real(*args)

    monkeypatch.setattr(module, name, counted)
    second = conversions.convert(to, after, FORM, SHARD_MIB[to])
    converted = [tuple(map(int, line.split())) for line in ranges.read_text().splitlines()]
    assert second.path != first.path and not second.reused and second.shards == len(table)
    assert second.kept == len(table) - 2  # the two shards of tar 2 converted again, no other
    # only samples near tar 2 (16-23 now): a shard of the earlier conversion that held any of them, no other
    start, stop = 2 * PER_TAR, 3 * PER_TAR - (change == "count")
    assert converted and all(start - 3 <= a and b <= stop + 3 for a, b in converted), converted
    assert sum(b - a for a, b in converted) < len(after) // 3
    kept = [p for p in second.path.glob("shard-*.bin" if to == "raw" else "shard-*.arrow") if p.stat().st_nlink > 1]
    # 4 samples a shard: the two shards of tar 2 converted, the others linked; but the Arrow shards after a sample
    # left, whose sample ids changed, are written again from the earlier ones' batches (nothing decoded)
    assert len(kept) == (len(table) - 2 if to == "raw" or change == "bytes" else 4)

    incremental = _stored(to, second.path, after)
    monkeypatch.setattr(module, name, real)
    scratch = conversions.convert(to, after, FORM, SHARD_MIB[to], force=True)
    assert _stored(to, scratch.path, after) == incremental
    assert [int(i) for i, _ in raw_format.read_manifest(scratch.path)["skipped"]] == []


def test_a_source_without_shard_keys_is_converted_whole(tmp_path, own_cache):
    make_image_folder(tmp_path / "folder", classes=2, per_class=4)
    config = _config(tmp_path, str(tmp_path / "folder"))
    dataset = open_dataset(config)
    assert shard_work.source_table(dataset) is None  # an ImageFolder: its samples are files of their own
    assert shard_work.plan(len(dataset), None, None) == [shard_work.Segment(0, len(dataset))]
