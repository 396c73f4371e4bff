"""The job's own dataset object as a source: a map-style torch `Dataset` (items `(image, target)` or dicts) or a
Hugging Face `datasets.Dataset`, handed to `make_loader` or made by the config's `dataset.factory`.

Every backend reads a sample as its encoded bytes (`read`), so the object is read as a folder of files would be:
an image that is encoded bytes, or a PIL image opened from a file, is read as it is stored; pixels (a PIL image
made in memory, a uint8 array or tensor) are stored as a lossless PNG, so every path decodes the same pixels.
Opening reads each sample once (labels, sizes and, without a version, the fingerprint: a hash of every sample),
unless the object says its labels (`targets`, a Hugging Face label column) and its version.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from loadopt.config_models import Config
from loadopt.errors import ConfigError, DatasetError, SampleProblem
from loadopt.named import import_named
from loadopt.storage.sources.request import SourceRequest

# Where a dict item keeps its image and label when the configured names (`dataset.columns`) are not there.
IMAGE_KEYS = ("image", "img", "jpg", "jpeg", "png", "webp")
LABEL_KEYS = ("label", "target", "cls", "class", "labels")
ACCEPTED = ("a map-style torch.utils.data.Dataset (len() and [i], items (image, target) or dicts) or a Hugging "
            "Face datasets.Dataset")


@dataclass
class UserDataset:
    """A dataset object's samples, read through its own `[i]`: labels and stored sizes taken once at open."""

    items: Any  # the object (a Hugging Face dataset with its image column left encoded)
    root: str  # what it is, for messages: `python:<module>.<class>` or the factory's name
    labels: np.ndarray  # int64
    sizes: np.ndarray  # int64, each sample's encoded bytes
    classes: list[str]
    fingerprint: str
    image_key: str | int  # the item's image: a dict key or column, or a tuple's position
    field_list: list[str] = field(default_factory=list)  # a dict item's other keys, a Hugging Face dataset's columns
    field_values: dict[str, list] | None = None  # each field's value per sample, where opening read them
    missing: dict[int, str] = field(default_factory=dict)  # samples without one of the fields: index -> which
    synthetic: bool = False
    converted: str | None = None
    left_out: list[str] = field(default_factory=list)
    fs: None = None  # read through the object: no filesystem, no tier
    kind: ClassVar[str] = "images"
    source_format: ClassVar[str] = "python"

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, index: int) -> bytes:
        return encoded_image(image_of(self.items[index], self.image_key, index), index)

    def path(self, index: int) -> str:
        return f"{self.root}[{index}]"

    def is_local(self) -> bool:
        return True

    def local_files(self) -> list[str]:
        return []

    def field_names(self, partial: bool = False) -> list[str]:
        return list(self.field_list)  # the first item's: those others lack are in `missing`

    def missing_fields(self, names: list[str]) -> dict[int, str]:
        return dict(self.missing)  # against the first item's keys, found while opening

    def fields(self, indices: np.ndarray, names: list[str]) -> dict[str, list]:
        rows = indices.tolist()
        if self.field_values is not None:
            return {name: [self.field_values[name][i] for i in rows] for name in names}
        if hasattr(self.items, "select_columns"):  # a Hugging Face dataset: the columns' rows, not the images
            return dict(self.items.select_columns(names)[rows])
        items = [self.items[i] for i in rows]
        return {name: [item.get(name) for item in items] for name in names}


def open_source(request: SourceRequest) -> UserDataset:
    """The dataset `dataset.factory` returns for the request's split (the factory called with `split=` where it
    takes one): the object, or (object, version) where a version string names its contents. Without a factory, the
    Hugging Face `save_to_disk` folder at the request's path (a DatasetDict's split)."""
    spec = request.config.dataset.factory
    if spec is None:
        return _saved(request)
    factory = import_named(spec, "dataset.factory")
    if not callable(factory):
        raise ConfigError(f"dataset.factory: {spec!r} is a {type(factory).__name__}, not a function")
    try:
        takes_split = "split" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_split = False
    try:
        made = factory(split=request.split) if takes_split else factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory may fail any way
        raise DatasetError(f"dataset.factory {spec} raised {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else 'no message'}") from None
    version = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], str):
        made, version = made
    return from_object(made, request.config, f"factory {spec}", version, request.progress, request.split)


def _saved(request: SourceRequest) -> UserDataset:
    """A `save_to_disk` folder: its Dataset, or its DatasetDict's split."""
    assert request.path is not None, "a saved folder is opened where it is"
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(f"{request.path}: a Hugging Face save_to_disk folder; reading it needs the datasets "
                          "package (pip install 'loadopt[trainers]')") from None
    try:
        saved = datasets.load_from_disk(request.path, storage_options=request.storage_options)
    except Exception as exc:  # noqa: BLE001 - the library's own failure on a damaged or partial folder
        raise DatasetError(f"{request.path}: cannot load the saved dataset ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else 'no message'})") from None
    if isinstance(saved, datasets.DatasetDict):
        if request.split not in saved:
            raise DatasetError(f"{request.path}: no split {request.split!r} (its splits: {', '.join(saved)})")
        saved = saved[request.split]
    return from_object(saved, request.config, f"{request.path}", None, request.progress, request.split)


def from_object(obj: Any, config: Config, name: str | None = None, version: str | None = None,
                progress: Callable[[int, int], None] | None = None, split: str = "train") -> UserDataset:
    """`obj` as a source; `name` says where it came from (default: its class), `version` names its contents (its
    fingerprint is otherwise a hash of every sample's bytes and label)."""
    module = type(obj).__module__
    where = name or f"python:{module}.{type(obj).__qualname__}"
    hugging_face = module.split(".")[0] == "datasets"
    if hugging_face and type(obj).__name__ in ("DatasetDict", "IterableDatasetDict"):
        raise ConfigError(f"{where}: a {type(obj).__name__} of splits {', '.join(obj)}; pass one of them "
                          f"(dataset[{split!r}])")
    if hugging_face and type(obj).__name__ == "IterableDataset":
        raise ConfigError(f"{where}: a streaming dataset has no len() or [i]; load it without streaming=True")
    if hugging_face and hasattr(obj, "features"):
        return _huggingface(obj, config, where, version)
    if not (hasattr(obj, "__getitem__") and hasattr(obj, "__len__")) or isinstance(obj, str | bytes | dict):
        raise ConfigError(f"{where}: a {type(obj).__name__} is not a dataset loadopt reads; it reads {ACCEPTED}")
    count = len(obj)
    if count == 0:
        raise DatasetError(f"{where}: the dataset has no samples")
    first = obj[0]
    columns = config.dataset.columns
    image_key = _key_of(first, columns.image, IMAGE_KEYS, 0, where, "image")
    label_key = _key_of(first, columns.label, LABEL_KEYS, 1, where, "label", needed=False)
    assert image_key is not None, "a needed key is found or refused"
    names = [k for k in first if k not in (image_key, label_key)] if isinstance(first, dict) else []
    targets = getattr(obj, "targets", None)
    labels = np.asarray(targets, dtype=np.int64) if _whole_numbers(targets, count) else None
    digest = hashlib.sha256(f"{where}\0{version}\0{count}".encode())
    read_labels = labels is None
    if read_labels:
        labels = np.zeros(count, np.int64)
    assert labels is not None
    gathered = _Gathered(names)
    try:
        sizes = _read_all(obj, first, image_key, label_key, labels, read_labels, digest,
                          version is None or read_labels or bool(names), version is None, where, progress, gathered)
    except SampleProblem as exc:
        raise DatasetError(str(exc)) from None
    if gathered.missing and config.dataset.on_error == "raise":
        index, why = next(iter(gathered.missing.items()))
        raise DatasetError(f"{where}[{index}]: {why} (set dataset.on_error: skip to skip it)")
    named = getattr(obj, "classes", None)
    classes = [str(c) for c in named] if isinstance(named, Sequence) and len(named) > int(labels.max(initial=0)) \
        else [str(c) for c in range(int(labels.max(initial=0)) + 1)]
    return UserDataset(obj, where, labels, sizes, classes, digest.hexdigest()[:16], image_key, names,
                       gathered.values if names else None, gathered.missing)


@dataclass
class _Gathered:
    """The fields of a dict item dataset as opening reads them (`_read_all`), and the samples missing one."""

    names: list[str]
    values: dict[str, list] = field(default_factory=dict)
    missing: dict[int, str] = field(default_factory=dict)

    def add(self, item: Any, index: int) -> None:
        for name in self.names:
            if not isinstance(item, dict) or name not in item:
                self.missing.setdefault(index, f"no field {name!r} (the first item has it)")
            self.values.setdefault(name, []).append(item.get(name) if isinstance(item, dict) else None)


def _read_all(obj: Any, first: Any, image_key: str | int, label_key: str | int | None, labels: np.ndarray,
              fill_labels: bool, digest: Any, every: bool, hashed: bool, where: str,
              progress: Callable[[int, int], None] | None, gathered: _Gathered) -> np.ndarray:
    """Each sample's encoded size, read once (`every`; else the first samples' mean stands for each: reading them
    all is what a version spares), filling `labels` from the items with `fill_labels`, the items' fields into
    `gathered` and, where `hashed`, the digest of every sample's bytes and label."""
    count = len(obj)
    sizes = np.zeros(count, np.int64)
    if not every:
        probe = range(min(64, count))
        sizes[:] = int(np.mean([len(encoded_image(image_of(obj[i], image_key, i), i, where)) for i in probe]))
        return sizes
    for i in range(count):
        item = first if i == 0 else obj[i]
        data = encoded_image(image_of(item, image_key, i), i, where)
        sizes[i] = len(data)
        if fill_labels and label_key is not None:
            labels[i] = _label_of(item, label_key, i, where)
        gathered.add(item, i)
        if hashed:
            digest.update(hashlib.sha256(data).digest() + int(labels[i]).to_bytes(8, "little", signed=True))
        if progress is not None and (i + 1) % 256 == 0:
            progress(i + 1, count)
    return sizes


def _huggingface(ds: Any, config: Config, where: str, version: str | None) -> UserDataset:
    """A Hugging Face dataset: its image column read undecoded (the stored bytes), its labels from their column,
    its fingerprint the library's own (it changes with every transformation of the data) or `version`."""
    from datasets import Image as ImageFeature

    columns = config.dataset.columns
    features = ds.features
    image = next((c for c in (columns.image, *IMAGE_KEYS) if c in features), None)
    if image is None:
        raise ConfigError(f"{where}: no image column (dataset.columns.image: {columns.image!r}; it has "
                          f"{', '.join(features)})")
    label = next((c for c in (columns.label, *LABEL_KEYS) if c in features), None)
    undecoded = ds.cast_column(image, ImageFeature(decode=False)) if isinstance(features[image], ImageFeature) \
        else ds
    count = len(ds)
    if count == 0:
        raise DatasetError(f"{where}: the dataset has no samples")
    labels = np.asarray(ds[label], dtype=np.int64) if label is not None else np.zeros(count, np.int64)
    names = getattr(features.get(label), "names", None) if label is not None else None
    classes = list(names) if names else [str(c) for c in range(int(labels.max(initial=0)) + 1)]
    sizes = _stored_lengths(undecoded, image)
    identity = version or getattr(ds, "_fingerprint", None) or ""
    fingerprint = hashlib.sha256(f"{where}\0{identity}\0{count}\0{image}\0{label}".encode()).hexdigest()[:16]
    others = [name for name in features if name not in (image, label)]
    return UserDataset(undecoded, where, labels, sizes, classes, fingerprint, image, others)


def _stored_lengths(ds: Any, column: str) -> np.ndarray:
    """Each row's stored image bytes, counted by Arrow over the column alone, a block of rows at a time (in the
    dataset's own order, a selection or shuffle included; never the images as Python objects). A cell with a path
    and no bytes counts its file's size."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out = []
    for block in ds.select_columns([column]).with_format("arrow").iter(batch_size=8192):
        cells = block.column(column)
        values = pc.struct_field(cells, "bytes") if pa.types.is_struct(cells.type) else cells
        lengths = pc.binary_length(values).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        if pa.types.is_struct(cells.type) and values.null_count:
            paths = pc.struct_field(cells, "path").to_pylist()
            for row in np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False)).tolist():
                lengths[row] = os.path.getsize(paths[row]) if paths[row] and os.path.isfile(paths[row]) else 0
        out.append(lengths)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _key_of(item: Any, configured: str, known: tuple[str, ...], position: int, where: str, what: str,
            needed: bool = True) -> str | int | None:
    """Where an item keeps its image (or label): a dict's key, or a tuple's position."""
    if isinstance(item, dict):
        key = next((k for k in (configured, *known) if k in item), None)
        if key is None and needed:
            raise ConfigError(f"{where}: item 0 is a dict without an {what} (dataset.columns.{what}: "
                              f"{configured!r}; its keys: {', '.join(map(str, item))})")
        return key
    if isinstance(item, tuple | list):
        if len(item) > position:
            return position
        if needed:
            raise ConfigError(f"{where}: item 0 is a {type(item).__name__} of {len(item)}; loadopt reads "
                              "(image, target) items or dicts")
        return None
    if position == 0:  # the item is the image itself
        return -1
    return None


def image_of(item: Any, key: str | int, index: int) -> Any:
    if key == -1:
        return item
    try:
        return item[key]
    except (KeyError, IndexError, TypeError):
        raise SampleProblem(f"sample {index} has no {key!r}") from None


def _label_of(item: Any, key: str | int, index: int, where: str) -> int:
    value = item[key] if not isinstance(item, dict) or key in item else None
    if value is not None and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise DatasetError(f"{where}[{index}]: its target {value!r} is not a class index (an int)")
    return int(value)


def _whole_numbers(values: Any, count: int) -> bool:
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        return False
    return array.shape == (count,) and array.dtype.kind in "iu"


def encoded_image(value: Any, index: int, where: str = "") -> bytes:
    """A sample's image as stored bytes: encoded bytes as they are (a Hugging Face `{bytes, path}` cell, a file's
    path), a PIL image opened from a file as that file holds it, uint8 pixels (PIL, HWC/HW array, CHW/HWC tensor)
    as a lossless PNG; anything else a `SampleProblem` saying what is accepted."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str | os.PathLike) and os.path.isfile(value):
        with open(value, "rb") as handle:
            return handle.read()
    if isinstance(value, Image.Image):
        filename = getattr(value, "filename", "")
        if value.format and filename and os.path.isfile(filename):  # as opened, unchanged: the file's bytes
            with open(filename, "rb") as handle:
                return handle.read()
        return _png(np.asarray(value.convert("RGB")))
    shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
    kind = f"{str(getattr(value, 'dtype', '')).removeprefix('torch.')} {type(value).__name__}".strip()
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
        if value.ndim == 3 and value.shape[0] in (1, 3) and value.shape[-1] not in (1, 3):
            value = value.transpose(1, 2, 0)
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and (
            value.ndim == 2 or value.ndim == 3 and value.shape[-1] in (1, 3, 4)):
        return _png(value)
    raise SampleProblem(f"{where + ': ' if where else ''}sample {index}'s image is a {kind}{shape}; loadopt reads "
                        "encoded image bytes, PIL images and uint8 pixels (give the dataset without "
                        "ToTensor/Normalize, and those as pipeline.transform or batch_transform)")


def _png(pixels: np.ndarray) -> bytes:
    """Pixels stored losslessly, quickly (zlib level 1): every path decodes exactly these."""
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).convert("RGB").save(out, format="PNG", compress_level=1)
    return out.getvalue()
