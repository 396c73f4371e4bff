"""Which format a dataset path holds (`dataset.format: auto`): an ImageFolder's class folders, WebDataset
tar shards, or Parquet files; and the shard files of one split, as both container formats name them."""

from __future__ import annotations

import itertools
import re

import fsspec

from loadopt.errors import DatasetError
from loadopt.storage.remote import redact

FORMATS = ("imagefolder", "webdataset", "parquet")
BRACE = re.compile(r"\{([^{}]*)\}")
GLOB_CHARS = ("*", "?", "[")


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


def _kinds(fs: fsspec.AbstractFileSystem, folder: str) -> tuple[list[str], list[str], list[str]]:
    """The .tar files, .parquet files and sub-folders directly in `folder` (their base names)."""
    tars, parquets, folders = [], [], []
    for info in fs.ls(folder, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") == "directory":
            folders.append(name)
        elif name.endswith(".tar"):
            tars.append(name)
        elif name.endswith(".parquet"):
            parquets.append(name)
    return tars, parquets, folders


def detect_format(fs: fsspec.AbstractFileSystem, path: str, split: str, shown: str) -> str:
    """imagefolder, webdataset or parquet, by what `path` holds; a path that is none of them is a
    DatasetError naming what is there. A missing path is left to the ImageFolder's own message."""
    if BRACE.search(path) or path.endswith(".tar") or any(c in path for c in GLOB_CHARS) and ".tar" in path:
        return "webdataset"
    if path.endswith(".parquet") or any(c in path for c in GLOB_CHARS):
        return "parquet"
    if not fs.exists(path) or not fs.isdir(path):
        return "imagefolder"
    tars, parquets, folders = _kinds(fs, path)
    if tars:
        return "webdataset"
    if parquets:
        return "parquet"
    for inner in ("data", split):
        if inner in folders:
            inner_tars, inner_parquets, _ = _kinds(fs, path.rstrip("/") + "/" + inner)
            if inner_parquets:
                return "parquet"
            if inner_tars:
                return "webdataset"
    if folders:
        return "imagefolder"
    files = [info["name"].rstrip("/").rsplit("/", 1)[-1] for info in fs.ls(path, detail=True)]
    listed = ", ".join(sorted(files)[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    raise DatasetError(f"{shown}: not a dataset loadopt reads (found {len(files)} file(s): {listed or 'nothing'}; "
                       "expected class folders (ImageFolder), .tar shards (WebDataset) or .parquet files)")


def labels_and_classes(values: list[int | str], names: list[str] | None, where: str) -> tuple[list[int], list[str]]:
    """Each sample's label index and the class names: integers as they are (named by `names` where given,
    else by their numbers), class-name strings by their index in `names` (else in their sorted set)."""
    if all(isinstance(v, int) for v in values):
        numbers = [int(v) for v in values]
        top = max(numbers, default=-1) + 1
        if names is not None and len(names) >= top:
            return numbers, list(names)
        return numbers, [str(n) for n in range(top)]
    classes = list(names) if names is not None else sorted({str(v) for v in values})
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted({str(v) for v in values if str(v) not in index})
    if unknown:
        raise DatasetError(f"{where}: labels {', '.join(unknown[:5])} are not among the class names "
                           f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})")
    return [index[str(v)] for v in values], classes
