"""The bad-input cases of tar and Parquet labels and of files loadopt does not read as shards (compressed
tars, a Parquet file with a damaged footer), for tests/test_bad_inputs.py's table: each prepares a dataset
and says the one line `loadopt bench` must print."""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .conftest import make_image_folder
from .faults import Setup, write_config
from .source_files import folder_samples, write_parquet, write_shards


def numbered_samples(tmp_path: Path, count: int = 20) -> list[tuple[str, int, bytes]]:
    """`count` photos (key, label, JPEG bytes), sample i labelled i: past 10 a text sort of the labels
    ('10' before '2') would renumber them, so a renumbering cannot pass unseen."""
    root = tmp_path / "photos"
    make_image_folder(root, classes=4, per_class=-(-count // 4))
    return [(key, i, data) for i, (key, _, data) in enumerate(folder_samples(root)[:count])]


def text_label_among_integers(tmp_path: Path, cache: Path) -> Setup:
    """A tar shard whose one `.cls` member holds `cat` among integers: named, never renumbering the others."""
    samples = numbered_samples(tmp_path)
    key, _, data = samples[7]
    labelled: list = [*samples[:7], (key, "cat", data), *samples[8:]]
    shards = write_shards(tmp_path / "shards", labelled, per_shard=10)
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "shards")})
    return Setup(["bench", str(config)], f"{shards[0]} (sample {key}, member {key}.cls): label 'cat' is not a "
                 "class number (an integer from 0; 19 of the 20 labels are); set dataset.on_error: skip to leave "
                 "it out (1 such in all)", config=config, backend="torch")


def null_parquet_label(tmp_path: Path, cache: Path) -> Setup:
    """A Parquet file with one null in its integer label column: the file and the row named."""
    samples = numbered_samples(tmp_path)
    table = pa.table({"image": pa.array([data for _, _, data in samples], pa.binary()),
                      "label": pa.array([None if i == 13 else label for i, (_, label, _) in enumerate(samples)],
                                        pa.int64())})
    path = tmp_path / "pq" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(table, path, row_group_size=5)
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "pq")})
    return Setup(["bench", str(config)], f"{path} (row 13): label null is not a class number (an integer from 0; "
                 "19 of the 20 labels are); set dataset.on_error: skip to leave it out (1 such in all)",
                 config=config, backend="torch")


def gzipped_tar_shards(tmp_path: Path, cache: Path) -> Setup:
    """Tar shards compressed with gzip: named, with why they are not read and what to do."""
    shards = write_shards(tmp_path / "shards", numbered_samples(tmp_path, 10), per_shard=5)
    for shard in shards:
        Path(f"{shard}.gz").write_bytes(gzip.compress(shard.read_bytes()))
        shard.unlink()
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "shards")})
    return Setup(["bench", str(config)], f"{shards[0]}.gz (and 1 more): compressed tar shards are not read",
                 config=config, backend="torch")


def damaged_parquet_footer(tmp_path: Path, cache: Path) -> Setup:
    """A Parquet file whose footer was cut off: the file named, not its folder."""
    files = write_parquet(tmp_path / "hub", folder_samples(make_photos(tmp_path)), ["c0", "c1"])
    files[1].write_bytes(files[1].read_bytes()[:-20])
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "hub")})
    return Setup(["bench", str(config)], f"{files[1]}: not a readable Parquet file (", config=config,
                 backend="torch")


def class_folders_without_images(tmp_path: Path, cache: Path) -> Setup:
    """Class folders holding files of no image extension: the line says what the folder holds instead."""
    for name in ("c0/scan.tif", "c0/notes.txt", "c1/scan.tif"):
        (tmp_path / "photos" / "train" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "photos" / "train" / name).write_bytes(b"not a photo")
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "photos")})
    return Setup(["bench", str(config)], f"{tmp_path / 'photos' / 'train'}: no images found (expected "
                 "<class>/<image>.jpg under it; found 3 file(s): 2 .tif, 1 .txt (c0/notes.txt, c0/scan.tif, "
                 "c1/scan.tif))", config=config, backend="torch")


def make_photos(tmp_path: Path) -> Path:
    make_image_folder(tmp_path / "photos", classes=2, per_class=5)
    return tmp_path / "photos"


LABEL_CASES = {
    "a text label among a tar shard's integer labels, bench": (text_label_among_integers, 1),
    "a null label in a Parquet file, bench": (null_parquet_label, 1),
    "gzip-compressed tar shards, bench": (gzipped_tar_shards, 1),
    "a Parquet file's footer damaged, bench": (damaged_parquet_footer, 1),
    "class folders of files that are not images, bench": (class_folders_without_images, 1),
}
