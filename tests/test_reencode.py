"""The encoded forms' JPEGs bounded by pipeline.max_side (`frame: whole`, stored form `reencoded`): a source
over the bound re-encoded at it, one within it kept coefficient for coefficient (with restart markers), in
both the Arrow and the raw form; its own cache key and recipe; a damaged large JPEG handled by
dataset.on_error like the other conversions."""

from __future__ import annotations

import io

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from loadopt import recipe
from loadopt.cli import app
from loadopt.config import config_from_dict
from loadopt.errors import DatasetError
from loadopt.imaging.reencode import REENCODE_QUALITY, bounded_jpeg, source_size, with_restarts
from loadopt.storage.forms import arrow_format, conversions, raw_format
from loadopt.storage.open import open_dataset

from .conftest import epoch_inputs, prepared_loader, tiny_config_dict

MAX_SIDE = 64
LARGE, SMALL = (200, 150), (48, 40)  # (width, height): over the bound (stored at 64 x 48), within it


def gradient(width: int, height: int) -> np.ndarray:
    x, y = np.linspace(20, 235, width), np.linspace(20, 235, height)
    pixels = np.empty((height, width, 3), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = x[None, :], y[:, None], 128
    return pixels


def jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(gradient(width, height)).save(out, format="JPEG", quality=95)
    return out.getvalue()


def folder(tmp_path, corrupt_large: bool = False):
    """Two classes, each a large and a small JPEG (the first class's large one truncated if asked)."""
    root = tmp_path / "images"
    for c in range(2):
        (root / "train" / f"c{c}").mkdir(parents=True)
        large = jpeg(*LARGE)
        if corrupt_large and c == 0:
            large = large[: len(large) // 2]  # a valid header, the scan cut off
        (root / "train" / f"c{c}" / "large.jpg").write_bytes(large)
        (root / "train" / f"c{c}" / "small.jpg").write_bytes(jpeg(*SMALL))
    return root


def config(tmp_path, root):
    raw = tiny_config_dict(tmp_path / "out", dataset={"path": str(root)},
                           pipeline={"max_side": MAX_SIDE, "image_size": 32})
    return config_from_dict(raw, "reencode.yaml")


def test_a_large_jpeg_is_stored_bounded_and_a_small_one_as_it_is():
    large, small = jpeg(*LARGE), jpeg(*SMALL)
    stored = bounded_jpeg(large, MAX_SIDE)
    assert source_size(stored) == (64, 48)
    pixels = np.asarray(Image.open(io.BytesIO(stored)).convert("RGB"), np.float64)
    reference = np.asarray(Image.fromarray(gradient(*LARGE)).resize((64, 48), Image.Resampling.BILINEAR), np.float64)
    assert np.abs(pixels - reference).mean() < 3  # the same frame, within the JPEG's loss
    kept = bounded_jpeg(small, MAX_SIDE)  # no recompression within the bound: its coefficients, with restarts
    assert kept == with_restarts(small) and kept != small
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(kept))), np.asarray(Image.open(io.BytesIO(small))))


@pytest.mark.parametrize("to", ["arrow", "raw"])
def test_the_conversion_stores_the_bounded_jpegs(tmp_path, to):
    cfg = config(tmp_path, folder(tmp_path))
    dataset = open_dataset(cfg)
    form = conversions.converted_form(cfg.pipeline, "encoded", None, "whole", False, where="test")
    assert (form.stored, form.size) == ("reencoded", MAX_SIDE)
    done = conversions.convert(to, dataset, form)
    if to == "arrow":
        rows = [bytes(b) for batch in arrow_format.open_arrow(done.path, dataset, "reencoded", MAX_SIDE)
                for b in batch.column(2).to_pylist()]
    else:
        raw = raw_format.open_raw(done.path, dataset, "reencoded", MAX_SIDE)
        rows = [(done.path / raw_format.shard_name(int(r["shard"]))).read_bytes()[r["offset"]:r["offset"] + r["length"]]
                for r in raw.index]
    for i, stored in enumerate(rows):
        source = dataset.read(i)
        if source_size(source) == SMALL:
            assert stored == with_restarts(source)
        else:
            assert source_size(stored) == (64, 48) and len(stored) < len(source)


def test_the_bounded_form_has_its_own_cache_key_and_recipe(tmp_path):
    cfg = config(tmp_path, folder(tmp_path))
    dataset = open_dataset(cfg)
    assert arrow_format.arrow_path(dataset, "reencoded", MAX_SIDE) != arrow_format.arrow_path(dataset, "encoded", None)
    assert arrow_format.arrow_path(dataset, "reencoded", MAX_SIDE) != arrow_format.arrow_path(dataset, "reencoded", 96)
    assert raw_format.raw_path(dataset, "reencoded", MAX_SIDE) != raw_format.raw_path(dataset, "encoded", None)
    # the sources' own bytes stay the encoded form's default
    assert conversions.converted_form(cfg.pipeline, "encoded", None, "auto", False, "test").stored == "encoded"
    delivered = recipe.delivered(cfg.pipeline, "whole", MAX_SIDE, reencoded_quality=REENCODE_QUALITY)
    assert delivered["stored"] == f"JPEG re-encoded <= {MAX_SIDE} px q{REENCODE_QUALITY}"
    assert not recipe.differences(delivered, recipe.wanted(cfg.pipeline))  # the config's recipe
    assert recipe.differences({**delivered, "max_side": 32}, recipe.wanted(cfg.pipeline))  # a smaller bound


def test_an_encoded_loader_reads_the_bounded_form(tmp_path):
    cfg = config(tmp_path, folder(tmp_path))
    loader = prepared_loader(cfg, open_dataset(cfg), "arrow", {"form": "encoded", "frame": "whole", "threads": 1})
    assert loader.stored_form == "reencoded"
    inputs = epoch_inputs(loader)
    assert sum(len(x) for x in inputs) == 4 and inputs[0].shape[-2:] == (32, 32)


@pytest.mark.parametrize("to", ["arrow", "raw"])
def test_a_damaged_large_jpeg_goes_by_on_error(tmp_path, to):
    root = folder(tmp_path, corrupt_large=True)
    bad = root / "train" / "c0" / "large.jpg"
    cfg = config(tmp_path, root)
    dataset = open_dataset(cfg)
    form = conversions.converted_form(cfg.pipeline, "encoded", None, "whole", False, where="test")
    with pytest.raises(DatasetError, match=str(bad)):
        conversions.convert(to, dataset, form)
    assert not conversions.conversion_path(to, dataset, "reencoded", MAX_SIDE).exists()  # nothing half-written
    done = conversions.convert(to, dataset, form, on_error="skip")  # what the backends pass: dataset.on_error
    assert done.skipped == 1


def test_the_cli_names_the_damaged_file_in_one_line(tmp_path):
    root = folder(tmp_path, corrupt_large=True)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "out", dataset={"path": str(root)},
                                                    pipeline={"max_side": MAX_SIDE, "image_size": 32})))
    result = CliRunner().invoke(app, ["convert", str(path), "--to", "raw", "--frame", "whole"])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and str(root / "train" / "c0" / "large.jpg") in lines[0], result.output
    assert "Traceback" not in result.output
