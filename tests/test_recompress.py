"""JPEG XL recompressed JPEGs (imaging/jxl.py) and `loadopt recompress` (storage/forms/recompress.py): the same JPEG
bytes given back, so every sample, label and pixel of the recompressed tars is the source's."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from loadopt.cli import app
from loadopt.errors import ConfigError, describe_sample_error
from loadopt.imaging import jxl
from loadopt.imaging.decode import decode_array, decode_pil
from loadopt.storage.forms.recompress import recompress_shards
from loadopt.storage.sources.webdataset import open_webdataset

from .source_files import write_shards

pytest.importorskip("imagecodecs", reason="the jxl extra (imagecodecs) is not installed")


def _photo(seed: int) -> bytes:
    """A photo-like JPEG (gradients and grain, 160 x 120, quality 90): large enough for JPEG XL to shrink."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:120, 0:160]
    pixels = np.stack([x * 1.5, y * 2.0, (x + y) * 0.8], axis=2) + rng.normal(0, 12, (120, 160, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def _png_bytes() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.arange(48 * 32 * 3, dtype=np.uint8).reshape(32, 48, 3)).save(out, "PNG")
    return out.getvalue()


@pytest.fixture
def shards(tmp_path):
    """Tar shards of 10 photos, 4 a shard, one of them a PNG under a .jpg name and one a damaged JPEG."""
    samples = [(f"s{i:04d}", i % 2, _photo(i)) for i in range(10)]
    samples[3] = (samples[3][0], samples[3][1], _png_bytes())
    samples[6] = (samples[6][0], samples[6][1], samples[6][2][: len(samples[6][2]) // 2])  # cut short
    write_shards(tmp_path / "shards", samples, per_shard=4)
    return tmp_path / "shards", samples


def test_a_recompressed_jpeg_gives_back_its_bytes_and_anything_else_stays(tmp_path):
    data = _photo(0)
    packed = jxl.recompress_jpeg(data)
    assert packed is not None and jxl.is_jxl(packed) and len(packed) < len(data)
    assert jxl.decodable(packed) == data
    assert jxl.decodable(data) is data  # a JPEG is passed through untouched
    assert jxl.recompress_jpeg(_png_bytes()) is None


def test_a_damaged_jpeg_xl_is_a_named_sample_error():
    packed = jxl.recompress_jpeg(_photo(1))
    assert packed is not None
    cut = packed[: len(packed) // 2]
    assert jxl.decodable(cut) == cut  # no JPEG rebuilt from half a file: the decoder says what is wrong
    with pytest.raises(Exception) as caught:
        decode_pil(cut)
    assert describe_sample_error(caught.value).startswith("truncated image")


def test_a_jpeg_xl_made_from_pixels_decodes_to_its_pixels():
    import imagecodecs

    pixels = np.arange(40 * 24 * 3, dtype=np.uint8).reshape(24, 40, 3)
    lossless = imagecodecs.jpegxl_encode(pixels, lossless=True)
    assert jxl.decodable(lossless) == lossless  # no JPEG inside
    assert np.array_equal(decode_array(lossless, "simplejpeg"), pixels)
    assert np.array_equal(np.asarray(decode_pil(lossless)), pixels)


def _member_names(shard: Path) -> list[str]:
    with tarfile.open(shard) as tar:
        return tar.getnames()


def test_recompressed_tars_read_back_as_the_same_samples(shards, tmp_path):
    source, samples = shards
    result = CliRunner().invoke(app, ["recompress", str(source), str(tmp_path / "packed")])
    assert result.exit_code == 0, result.output
    assert "8 JPEGs recompressed, 2 kept as they were" in " ".join(result.output.split())
    kept = (samples[3][0], samples[6][0])
    names = [name for shard in sorted((tmp_path / "packed").glob("*.tar")) for name in _member_names(shard)]
    assert names == [name.replace(".jpg", ".jxl") if name.split(".")[0] not in kept else name
                     for shard in sorted(source.glob("*.tar")) for name in _member_names(shard)]
    before, after = open_webdataset(str(source)), open_webdataset(str(tmp_path / "packed"))
    assert after.sizes.sum() < before.sizes.sum()
    assert list(after.keys) == list(before.keys) and list(after.labels) == list(before.labels)
    for i in range(len(before)):
        assert after.read(i) == before.read(i), before.path(i)  # the very bytes: every pixel and crop the same


def test_recompress_goes_on_where_it_stopped_and_force_writes_again(shards, tmp_path):
    source, _ = shards
    target = tmp_path / "packed"
    first = recompress_shards(source, target, workers=1)
    (target / "train-000001.tar").unlink()  # as if stopped before this shard was renamed into place
    again = recompress_shards(source, target, workers=1)
    assert [s.reused for s in again.shards] == [True, False, True]
    assert again.bytes_after == first.bytes_after
    forced = recompress_shards(source, target, workers=1, force=True)
    assert not any(s.reused for s in forced.shards)
    assert not [p for p in target.iterdir() if ".tmp-" in p.name]


# The command's bad inputs are rows of tests/test_bad_inputs.py's table (tests/bad_recompress_inputs.py).


def test_jpeg_xl_images_in_an_image_folder_and_parquet_read_back_as_their_jpegs(tmp_path):
    """Every source gives back the JPEG a recompressed image was made from: an ImageFolder's .jxl files and
    Parquet's image bytes, as tar shards' .jxl members (above)."""
    from loadopt.storage.sources.imagefolder import scan_image_folder
    from loadopt.storage.sources.parquet import open_parquet

    from .source_files import write_parquet

    photos = [_photo(seed) for seed in range(4)]
    packed = [jxl.recompress_jpeg(photo) for photo in photos]
    assert all(p is not None for p in packed)
    for n, data in enumerate(packed):
        folder = tmp_path / "folder" / "train" / f"c{n % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{n}.jxl").write_bytes(data)  # type: ignore[arg-type]
    dataset = scan_image_folder(str(tmp_path / "folder"))
    assert sorted(dataset.read(i) for i in range(len(dataset))) == sorted(photos)
    write_parquet(tmp_path / "pq", [(f"s{n}", n % 2, data) for n, data in enumerate(packed)],  # type: ignore[misc]
                  ["c0", "c1"], files=1)
    table = open_parquet(str(tmp_path / "pq"))
    assert [table.read(i) for i in range(len(table))] == photos


def test_reading_a_jpeg_xl_without_imagecodecs_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "imagecodecs", None)
    with pytest.raises(ConfigError, match=r"pip install 'loadopt\[jxl\]'"):
        jxl.decodable(jxl.JXL_CODESTREAM + b"\0" * 32)


def test_through_the_shard_cache_each_jpeg_is_rebuilt_once_per_cache(served, own_cache, monkeypatch):
    """A recompressed shard read through the shard cache: its JPEG XL members' JPEGs are rebuilt once, kept beside
    its copy (counted in the limit), and every later read, by any process, reads them; where they cannot be kept
    (no room) each read rebuilds its member, as before. The same bytes either way."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    import shutil

    from loadopt.storage.open import open_dataset

    from .cache_serving import cache_config, folder_bytes

    url, root = served
    samples = [(f"p{i:04d}", i % 2, _photo(100 + i)) for i in range(8)]
    write_shards(root / "photos-plain", samples, per_shard=4)
    recompress_shards(root / "photos-plain", root / "photos-jxl")
    shutil.copytree(root / "photos-jxl", root / "photos-jxl-tight")  # the same tars, another location: its own cache
    rebuilds = []
    decode = jxl.decodable
    monkeypatch.setattr(jxl, "decodable", lambda data: rebuilds.append(1) or decode(data))

    limit = 10 << 20
    dataset = open_dataset(cache_config(f"{url}/photos-jxl", limit))
    order = [5, 0, 7, 2, 1, 6, 3, 4]
    assert [dataset.read(i) for i in order] == [samples[i][2] for i in order]
    assert len(rebuilds) == 8  # each member once: the first read of a shard rebuilt all four of its members
    counts = dataset.fs.cache_counters()
    assert counts.derived_files == 2 and counts.derived_bytes > sum(len(s[2]) for s in samples)
    assert folder_bytes(dataset.fs.store.folder / "files") <= limit
    rebuilds.clear()
    again = open_dataset(cache_config(f"{url}/photos-jxl", limit))  # another job (or worker) on the same cache
    assert [again.read(i) for i in range(8)] == [s[2] for s in samples] and rebuilds == []

    copies = sum(p.stat().st_size for p in (root / "photos-jxl").glob("*.tar"))
    tight = open_dataset(cache_config(f"{url}/photos-jxl-tight", copies + 4096))
    rebuilds.clear()
    assert [tight.read(i) for i in range(8)] == [s[2] for s in samples]
    assert len(rebuilds) == 8 and tight.fs.cache_counters().derived_files == 0  # no room beside the copies
