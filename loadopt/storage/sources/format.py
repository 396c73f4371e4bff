"""Which format a dataset path holds (`dataset.format: auto`): an ImageFolder's class folders, WebDataset
tar shards, or Parquet files; and the shard files of one split, as both container formats name them."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import fsspec
import numpy as np

from loadopt.errors import DatasetError
from loadopt.storage.remote.access import redact

FORMATS = ("imagefolder", "webdataset", "parquet")
BRACE = re.compile(r"\{([^{}]*)\}")
GLOB_CHARS = ("*", "?", "[")
INTEGER_TEXT = re.compile(r"\s*[+-]?\d+\s*")
COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace notation expanded: `{000..012}` a zero-padded range, `{a,b}` alternatives."""
    choices: list[list[str]] = []
    for inside in BRACE.findall(pattern):
        if ".." in inside:
            low, high = inside.split("..", 1)
            if not (low.isdigit() and high.isdigit()):
                raise DatasetError(f"{redact(pattern)}: {{{inside}}} is not a range of numbers (as {{000..127}})")
            width = len(low) if low.startswith("0") else 0
            choices.append([str(n).zfill(width) for n in range(int(low), int(high) + 1)])
        else:
            choices.append(inside.split(","))
    pieces = BRACE.split(pattern)[::2]
    names = []
    for picked in itertools.product(*choices):
        names.append("".join(p + c for p, c in zip(pieces, picked, strict=False)) + pieces[-1])
    return names


def split_of(name: str) -> str | None:
    """The split a shard's file name says (`train-00000-of-00042.parquet`, `val-000001.tar`), else None."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    found = re.match(r"([A-Za-z]+)[-_.]", base)
    return found.group(1) if found else None


def of_split(names: list[str], split: str, where: str) -> list[str]:
    """The files of `split` among `names`: those its name prefixes; all of them for train when no name
    says a split."""
    named = [n for n in names if split_of(n) in (split, "validation" if split == "val" else split)]
    if named:
        return sorted(named)
    splits = sorted({s for s in map(split_of, names) if s})
    if split == "train" and not any(s in ("train", "val", "validation", "test") for s in splits):
        return sorted(names)
    raise DatasetError(f"{where}: no {split!r} files (splits named there: {', '.join(splits) or 'none'})")


def compressed_tars(names: list[str]) -> DatasetError:
    """The one line for compressed tar shards (`names` as shown): why they are not read and what to do."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return DatasetError(f"{names[0]}{more}: compressed tar shards are not read (a sample is read at its offset in "
                        "the tar, which a compressed stream cannot give); decompress them into .tar shards "
                        "(`gunzip` turns x.tar.gz or x.tgz into x.tar) and point dataset.path at those")


def raise_if_compressed(names: list[str]) -> None:
    """`compressed_tars` where any of `names` is a compressed tar."""
    compressed = sorted(n for n in names if n.lower().endswith(COMPRESSED_TARS))
    if compressed:
        raise compressed_tars(compressed)


def what_is_there(fs: fsspec.AbstractFileSystem, folder: str, shown: str) -> str:
    """What a folder holding none of the expected files holds (two levels down), for a message: its files
    counted by extension and the first few named; compressed tar shards are their own error."""
    found = fs.find(folder, maxdepth=2, detail=True)
    files = sorted(name for name, info in found.items() if info.get("type") != "directory")
    inside = [f"{shown.rstrip('/')}/{name[len(folder.rstrip('/')) + 1:]}" for name in files]
    raise_if_compressed(inside)
    if not files:
        return "found no files"
    extensions: dict[str, int] = {}
    for name in files:
        base = name.rsplit("/", 1)[-1]
        extension = "." + base.rsplit(".", 1)[-1].lower() if "." in base else "no extension"
        extensions[extension] = extensions.get(extension, 0) + 1
    counted = ", ".join(f"{count} {extension}" for extension, count in sorted(extensions.items(),
                                                                                key=lambda item: -item[1]))
    named = ", ".join(name[len(folder.rstrip("/")) + 1:] for name in files[:3])
    return f"found {len(files)} file(s): {counted} ({named}{', ...' if len(files) > 3 else ''})"


def _kinds(fs: fsspec.AbstractFileSystem, folder: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """The .tar files, .parquet files, sub-folders and compressed tars directly in `folder` (base names)."""
    tars, parquets, folders, compressed = [], [], [], []
    for info in fs.ls(folder, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") == "directory":
            folders.append(name)
        elif name.endswith(".tar"):
            tars.append(name)
        elif name.endswith(".parquet"):
            parquets.append(name)
        elif name.lower().endswith(COMPRESSED_TARS):
            compressed.append(name)
    return tars, parquets, folders, compressed


# What `datasets`' `save_to_disk` leaves in its folder: a Dataset's state, or a DatasetDict's list of splits.
HUGGING_FACE_MARKERS = ("state.json", "dataset_dict.json")


def detect_format(fs: fsspec.AbstractFileSystem, path: str, split: str, shown: str) -> str:
    """imagefolder, webdataset, parquet or huggingface (a `save_to_disk` folder), by what `path` holds; a path that
    is none of them is a DatasetError naming what is there. A missing path is left to the ImageFolder's own
    message."""
    if path.lower().endswith(COMPRESSED_TARS) and not any(c in path for c in GLOB_CHARS) and not BRACE.search(path):
        raise compressed_tars([shown])
    if BRACE.search(path) or path.endswith(".tar") or any(c in path for c in GLOB_CHARS) and ".tar" in path:
        return "webdataset"
    if path.endswith(".parquet") or any(c in path for c in GLOB_CHARS):
        return "parquet"
    if not fs.exists(path) or not fs.isdir(path):
        return "imagefolder"
    if any(fs.exists(f"{path.rstrip('/')}/{marker}") for marker in HUGGING_FACE_MARKERS):
        return "huggingface"
    tars, parquets, folders, compressed = _kinds(fs, path)
    if tars:
        return "webdataset"
    if parquets:
        return "parquet"
    for inner in ("data", split):
        if inner in folders:
            inner_tars, inner_parquets, _, inner_compressed = _kinds(fs, path.rstrip("/") + "/" + inner)
            if inner_parquets:
                return "parquet"
            if inner_tars:
                return "webdataset"
            raise_if_compressed([f"{shown.rstrip('/')}/{inner}/{name}" for name in inner_compressed])
    raise_if_compressed([f"{shown.rstrip('/')}/{name}" for name in compressed])
    if folders:
        return "imagefolder"
    files = [info["name"].rstrip("/").rsplit("/", 1)[-1] for info in fs.ls(path, detail=True)]
    listed = ", ".join(sorted(files)[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    raise DatasetError(f"{shown}: not a dataset loadopt reads (found {len(files)} file(s): {listed or 'nothing'}; "
                       "expected class folders (ImageFolder), .tar shards (WebDataset), .parquet files or a Hugging "
                       "Face save_to_disk folder)")


# Part of the identity of tar and Parquet indexes and listings: indexes built under the earlier rule (a
# text label among integers renumbered every class as sorted text) are not reused.
LABEL_RULE = "labels2"


@dataclass
class ClassNumbers:
    """Each sample's class number (-1 where its label is not one), the class names, and what is wrong with
    each bad label (by the sample's position)."""

    numbers: np.ndarray  # int64
    classes: list[str]
    wrong: dict[int, str]


def label_integer(value: object) -> int | None:
    """The integer a label spells: an integer, an integral float, or the text of one; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return int(value) if float(value).is_integer() else None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str) and INTEGER_TEXT.fullmatch(value):
        return int(value)
    return None


def shown_label(value: object) -> str:
    """A label's value for a message: text quoted, a missing value as null."""
    return "null" if value is None else repr(value)


def class_numbers(values: list[object], names: list[str] | None) -> ClassNumbers:
    """Each sample's class number and the class names.

    With `names` (a Hugging Face ClassLabel's): an integer indexes them, a string is looked up among them.
    Without: where any label is an integer, labels are class numbers kept as written (the classes numbered
    0 to the largest); where none is, labels are class names (the classes their sorted set, as ImageFolder's
    folders). Any other label (text among integers, null, a fractional or negative number) is in `wrong`."""
    integers = [label_integer(v) for v in values]
    numbers = np.full(len(values), -1, dtype=np.int64)
    wrong: dict[int, str] = {}
    if names is not None:
        index = {name: i for i, name in enumerate(names)}
        listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        for i, (value, number) in enumerate(zip(values, integers, strict=True)):
            if isinstance(value, str) and value in index:
                numbers[i] = index[value]
            elif number is not None and 0 <= number < len(names):
                numbers[i] = number
            else:
                wrong[i] = (f"label {shown_label(value)} is neither a class number 0-{len(names) - 1} nor a name "
                            f"of the dataset's {len(names)} classes ({listed})")
        return ClassNumbers(numbers, list(names), wrong)
    counted = sum(number is not None for number in integers)
    if counted:
        for i, number in enumerate(integers):
            if number is None or number < 0:
                wrong[i] = (f"label {shown_label(values[i])} is not a class number (an integer from 0; "
                            f"{counted} of the {len(values)} labels are)")
            else:
                numbers[i] = number
        top = int(numbers.max(initial=-1)) + 1
        return ClassNumbers(numbers, [str(n) for n in range(top)], wrong)
    classes = sorted({v for v in values if isinstance(v, str) and v})
    index = {name: i for i, name in enumerate(classes)}
    for i, value in enumerate(values):
        if isinstance(value, str) and value in index:
            numbers[i] = index[value]
        else:
            wrong[i] = f"label {shown_label(value)} is neither a class number nor a class name"
    return ClassNumbers(numbers, classes, wrong)
