"""The bad inputs of a conversion's integrity (rows of tests/test_bad_inputs.py's table): a raw shard's index cut
short or a row of it overwritten with its neighbour's (the index files are under the manifest's checksums, checked
at open for the shards sampled there), an Arrow shard cut short (the line says the command that rebuilds it), and
a tar member that is no image, found by the encoded conversion (its header read), not by a later bench. `loadopt
convert --verify` converts the damaged conversions again (tests/test_faults.py)."""

from __future__ import annotations

import tarfile

import numpy as np
import pytest
from typer.testing import CliRunner

from loadopt.cli import app

from .faults import Setup, images, temps, write_config
from .source_files import folder_samples, write_shards

REBUILD_RAW = "run `loadopt convert CONFIG --to raw --force` to rebuild it"
REBUILD_ARROW = "run `loadopt convert CONFIG --to arrow --force` to rebuild it"


def _raw_conversion(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"posix": {"form": "encoded"}})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "raw"]).exit_code == 0
    (index,) = (cache / "raw").glob("*-encoded-*/shard-00000.idx.npy")
    return config, index


def raw_index_cut_short(tmp_path, cache):
    config, index = _raw_conversion(tmp_path, cache)
    index.write_bytes(index.read_bytes()[:-80])  # its last two rows
    return Setup(["bench", str(config), "--no-convert"], f"{index}: checksum mismatch: the converted file is damaged "
                 f"({REBUILD_RAW})", config=config, backend="posix", overrides={"form": "encoded"})


def raw_index_row_of_its_neighbour(tmp_path, cache):
    config, index = _raw_conversion(tmp_path, cache)
    rows = np.load(index)
    rows[3] = rows[4]  # a well-formed row, in bounds: only the checksum tells
    np.save(index, rows)
    return Setup(["bench", str(config), "--no-convert"], f"{index}: checksum mismatch: the converted file is damaged "
                 f"({REBUILD_RAW})", config=config, backend="posix", overrides={"form": "encoded"})


def arrow_shard_cut_short(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"arrow": {"form": "encoded"}})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    (shard,) = (cache / "arrow").glob("*-encoded-*/shard-00000.arrow")
    shard.write_bytes(shard.read_bytes()[:-300])  # an interrupted copy: the footer gone
    return Setup(["bench", str(config), "--no-convert"], f"{shard}: corrupt or truncated Arrow shard (the manifest "
                 f"lists it: samples 0-9); {REBUILD_ARROW}", config=config, backend="arrow",
                 overrides={"form": "encoded"})


def tar_member_not_an_image(to: str, backend: str):
    """Tar shards whose sample s0003's image member holds other bytes, converted in the encoded form (the source's
    bytes stored): the conversion reads each member's header, so it fails naming the tar and the member."""

    def make(tmp_path, cache):
        root, _ = images(tmp_path, corrupt=0)
        samples = folder_samples(root)
        key, label, _ = samples[3]
        samples[3] = (key, label, b"not an image at all" * 10)
        shards = write_shards(tmp_path / "shards", samples, per_shard=5)
        with tarfile.open(shards[0]) as archive:
            member = archive.getmember(f"{key}.jpg")
        config = write_config(tmp_path, dataset={"path": str(tmp_path / "shards")})
        culprit = (f"{shards[0]} (sample {key}, bytes {member.offset_data}-{member.offset_data + member.size}): not "
                   "a readable image")
        return Setup(["convert", str(config), "--to", to], culprit, config=config, backend=backend,
                     overrides={"form": "encoded"}, leftovers=temps(cache),
                     after=lambda: not list((cache / to).rglob("manifest.json")) or pytest.fail("a conversion kept"))

    return make


INTEGRITY_CASES = {  # name: (setup, exit code)
    "a raw shard's index cut short, bench": (raw_index_cut_short, 1),
    "a raw index row overwritten with its neighbour's, bench": (raw_index_row_of_its_neighbour, 1),
    "an Arrow shard cut short, bench": (arrow_shard_cut_short, 1),
    "a tar member that is no image, encoded Arrow conversion": (tar_member_not_an_image("arrow", "arrow"), 1),
    "a tar member that is no image, encoded raw conversion": (tar_member_not_an_image("raw", "posix"), 1),
}
