"""Dataset files in the formats people ship, written as their libraries write them: WebDataset tar shards
(`ShardWriter`'s layout) and Parquet (Hugging Face `datasets`' `Image()` layout, written by pyarrow), made
from an ImageFolder's samples. Shared by test_sources.py and the bad-input table."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loadopt.storage.sources.imagefolder import scan_image_folder

LONG_KEY = "deep/" + "x" * 120  # a member name over 100 characters: GNU `././@LongLink` or a pax header


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    archive.addfile(info, io.BytesIO(data))


def folder_samples(root: Path) -> list[tuple[str, int, bytes]]:
    """(key, label, JPEG bytes) of an ImageFolder's train split, in its order."""
    dataset = scan_image_folder(str(root))
    return [(f"s{i:04d}", int(dataset.labels[i]), dataset.read(i)) for i in range(len(dataset))]


def write_shards(folder: Path, samples: list[tuple[str, int, bytes]], per_shard: int, split: str = "train",
                 labels_in: str = "cls", tar_format: int = tarfile.GNU_FORMAT, extra: bool = False) -> list[Path]:
    """Tar shards `<split>-NNNNNN.tar` of the samples, as WebDataset's ShardWriter lays them out; `extra`
    adds a sample with a long name and a sample without an image member to the first shard."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for number, start in enumerate(range(0, len(samples), per_shard)):
        path = folder / f"{split}-{number:06d}.tar"
        with tarfile.open(path, "w", format=tar_format) as archive:
            if extra and number == 0:
                _add(archive, f"{LONG_KEY}.txt", b"metadata only")  # no image member
            for key, label, data in samples[start:start + per_shard]:
                _add(archive, f"{key}.jpg", data)
                if labels_in == "cls":
                    _add(archive, f"{key}.cls", str(label).encode())
                else:
                    _add(archive, f"{key}.json", json.dumps({"target": label, "caption": key}).encode())
        shards.append(path)
    return shards


def write_parquet(folder: Path, samples: list[tuple[str, int, bytes]], classes: list[str], hf: bool = True,
                  files: int = 2, rows_per_group: int = 3) -> list[Path]:
    """Parquet files of the samples: Hugging Face's layout (`data/train-0000N-of-0000M.parquet`, an image
    struct of `{bytes, path}`, a ClassLabel `label` named in the `huggingface` metadata), as `datasets`'
    `Dataset.to_parquet` writes an `Image()` feature; else plain binary `jpg` and integer `cls` columns."""
    out = folder / "data" if hf else folder
    out.mkdir(parents=True, exist_ok=True)
    per_file = -(-len(samples) // files)
    written = []
    for number in range(files):
        chunk = samples[number * per_file:(number + 1) * per_file]
        if hf:
            image = pa.array([{"bytes": data, "path": f"{key}.jpg"} for key, _, data in chunk],
                             type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
            features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
            table = pa.table({"image": image, "label": pa.array([label for _, label, _ in chunk], pa.int64())})
            table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
            path = out / f"train-{number:05d}-of-{files:05d}.parquet"
        else:
            table = pa.table({"jpg": pa.array([data for _, _, data in chunk], pa.binary()),
                              "cls": pa.array([label for _, label, _ in chunk], pa.int32())})
            path = out / f"part-{number}.parquet"
        pq.write_table(table, path, row_group_size=rows_per_group)
        written.append(path)
    return written
