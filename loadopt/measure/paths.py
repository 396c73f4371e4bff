"""The end of `loadopt measure`: the measured loop's own pipeline run on loadopt's paths, beside its DataLoader.

From the DataLoader the script iterated most, it takes the dataset and its per-sample transform where it can see
them apart (a torchvision-style dataset with `.transform`, or a Hugging Face dataset whose `set_transform` function
applies one torchvision-style composition to each image: its `ToTensor`/`Normalize` tail becomes loadopt's
device-side normalisation, the rest the job's transform with `augment: none`), and the DataLoader's own knobs
(batch size, workers). The DataLoader itself and each loadopt path that runs a per-sample transform then deliver
the same number of batches of the first samples, loader-bound (no step), one after another; the line says which
path would feed that loop fastest, and by how much.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadopt.config import config_from_dict
from loadopt.device import resolve_device
from loadopt.errors import LoadoptError
from loadopt.loaders.registry import backend_class, configured_loader
from loadopt.loaders.sample_transform import SampleTransform
from loadopt.machine import usable_cores
from loadopt.named import name_of
from loadopt.storage.sources.user import from_object

log = logging.getLogger("loadopt.measure")

# A torchvision-style transform's tail that loadopt does on the device instead: to a tensor, normalised.
TENSOR_TAIL = ("ToTensor", "PILToTensor", "ToImage", "ToDtype", "ConvertImageDtype", "Normalize")
SAMPLES = 2048  # the first samples the paths read (each loadopt path converts what it reads once, in the cache)
BATCHES = 20  # timed per path, after 3 not timed


@dataclass
class JobPipeline:
    """What the measured loop's DataLoader does per sample, as loadopt runs it."""

    dataset: Any  # the dataset object with its transform taken off (its first `SAMPLES`)
    dataset_name: str  # what it is, for the line
    transform: Callable[[Any], Any] | None  # the rest of its transform (crops, augmentations)
    transform_name: str  # the job's transform as a config names one (its recipe's `transform`)
    described: str  # the transform's steps, for the line
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    batch_size: int
    workers: int


class _Steps:
    """A torchvision-style transform's steps before its tensor tail, called in turn."""

    def __init__(self, steps: list[Callable[[Any], Any]]) -> None:
        self.steps = steps

    def __call__(self, image: Any) -> Any:
        for step in self.steps:
            image = step(image)
        return image


class _First:
    """The first `count` samples of a dataset, with its `targets` and `classes` where it has them. A torchvision-style
    `DatasetFolder` (`.samples`: (path, class) pairs) is read as its files: each sample is its file's bytes, not the
    image its loader decoded and converted (which loadopt would have to store again)."""

    def __init__(self, dataset: Any, count: int) -> None:
        self.dataset, self.count = dataset, count
        samples = getattr(dataset, "samples", None)
        self.files = samples if isinstance(samples, list) and samples and isinstance(samples[0], tuple) \
            and isinstance(samples[0][0], str) else None
        targets = getattr(dataset, "targets", None)
        if targets is not None:
            self.targets = list(targets)[:count]
        if hasattr(dataset, "classes"):
            self.classes = dataset.classes

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Any:
        if self.files is not None:
            return self.files[index]
        return self.dataset[index]


def referenced(function: Callable[..., Any]) -> list[Any]:
    """The objects a function uses by name: its closure's cells and the module globals its code (and the code of
    the comprehensions and functions within it) names."""
    found = [cell.cell_contents for cell in (getattr(function, "__closure__", None) or ())
             if cell.cell_contents is not function]
    module = getattr(function, "__globals__", {})
    codes = [getattr(function, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is None:
            continue
        found += [module[name] for name in code.co_names if name in module]
        codes += [const for const in code.co_consts if hasattr(const, "co_names")]
    return found


def hugging_face_transform(dataset: Any) -> tuple[Any, Any] | str | None:
    """A Hugging Face dataset's `set_transform`/`with_transform` function taken apart: (the dataset without it, the
    torchvision-style composition the function applies to each image); why not; None for any other dataset."""
    format_of = getattr(dataset, "format", None)
    if not (hasattr(dataset, "with_format") and isinstance(format_of, dict)):
        return None
    function = (format_of.get("format_kwargs") or {}).get("transform")
    if format_of.get("type") != "custom" or function is None:
        return None
    compositions = [value for value in referenced(function)
                    if isinstance(getattr(value, "transforms", None), list) and callable(value)]
    if len(compositions) != 1:
        return (f"its Hugging Face dataset's transform {name_of(function)} uses "
                f"{len(compositions) or 'no'} torchvision-style compositions (Compose) by name, not one to run on "
                "each image")
    return dataset.with_format(None), compositions[0]


def job_pipeline(loader: Any) -> JobPipeline | str:
    """The measured DataLoader's pipeline, or why loadopt cannot run it apart from its dataset."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return "its dataset is not a map-style dataset (len() and [i])"
    hugging_face = hugging_face_transform(dataset)
    if isinstance(hugging_face, str):
        return hugging_face
    if hugging_face is not None:
        bare, transform = hugging_face
        return _taken_apart(loader, transform, bare, bare.select(range(min(SAMPLES, len(bare)))),
                            f"Hugging Face {type(bare).__name__}")
    transform = getattr(dataset, "transform", None)
    if transform is None:
        return ("its dataset has no `.transform` to take apart from the images (a torchvision-style dataset has one; "
                "make_loader(dataset, transform=fn) takes any other)")
    if getattr(dataset, "target_transform", None) is not None:
        return "its dataset has a target_transform, which loadopt's paths do not run"
    bare = copy.copy(dataset)
    bare.transform = None
    return _taken_apart(loader, transform, bare, _First(bare, min(SAMPLES, len(bare))), type(bare).__name__)


def _taken_apart(loader: Any, transform: Any, bare: Any, first_samples: Any, dataset_name: str
                 ) -> JobPipeline | str:
    """The pipeline of `loader` whose dataset without its transform is `bare` (`first_samples`: what the paths
    read) and whose per-image transform is `transform` (a composition's tensor tail done on the device)."""
    steps = list(getattr(transform, "transforms", [transform]))
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    tail = []
    while steps and type(steps[-1]).__name__ in TENSOR_TAIL:
        step = steps.pop()
        tail.append(type(step).__name__)
        if type(step).__name__ == "Normalize":
            mean, std = tuple(float(v) for v in step.mean), tuple(float(v) for v in step.std)
    later = [type(s).__name__ for s in steps if type(s).__name__ in TENSOR_TAIL]
    if later:
        return (f"its transform works on tensors after {later[0]} (e.g. RandomErasing): loadopt runs a transform "
                "of images, and batch_transform on the device")
    if len(mean) != 3 or len(std) != 3:
        return "its Normalize is not of 3 channels"
    rest = _Steps(steps) if steps else None
    first = bare[0]
    image = first[0] if isinstance(first, tuple | list) else first
    if isinstance(first, dict):  # a dict item (a Hugging Face dataset's row): its image
        image = next((value for value in first.values() if hasattr(value, "convert")), None)
        image = image.convert("RGB") if image is not None else None
    shaped = rest(image) if rest is not None else image
    size = getattr(shaped, "size", None)
    if not isinstance(size, tuple) or len(size) != 2 or size[0] != size[1]:
        return f"its transform's images are not square ({size}): loadopt's batches are"
    described = ", ".join(type(s).__name__ for s in steps) + (f" + {'/'.join(reversed(tail))} on the device"
                                                               if tail else "")
    return JobPipeline(first_samples, dataset_name, rest, name_of(transform), described, int(size[0]),
                       mean, std, int(getattr(loader, "batch_size", None) or 1),
                       int(getattr(loader, "num_workers", 0)))


def timed(batches: Iterable[Any], count: int) -> float:
    """Samples per second over `count` batches after 3 not timed (a batch's first element's length, or its first
    value's: a Hugging Face dataset's batches are dicts)."""
    iterator: Iterator[Any] = iter(batches)
    for _ in range(3):
        next(iterator)
    start, samples = time.perf_counter(), 0
    for _ in range(count):
        batch = next(iterator)
        samples += len(next(iter(batch.values())) if isinstance(batch, dict) else batch[0])
    return samples / (time.perf_counter() - start)


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def path_rates(job: JobPipeline, own: Callable[[], Iterable[Any]]) -> list[tuple[str, float | str]]:
    """(label, samples/s or why not) of the DataLoader (`own()` makes a fresh one) and each loadopt path."""
    cores = usable_cores()
    config = config_from_dict({"pipeline": {"batch_size": job.batch_size, "image_size": job.image_size,
                                            "augment": "none" if job.transform is not None else "eval",
                                            "transform": job.transform_name if job.transform else None,
                                            "mean": job.mean, "std": job.std, "shuffle": True}}, "loadopt measure")
    rates: list[tuple[str, float | str]] = [(f"your DataLoader (workers={job.workers})",
                                             timed(forever(own()), BATCHES))]
    dataset = from_object(job.dataset, config)
    paths = [("torch", {"variant": "tuned", "num_workers": max(job.workers, cores)}),
             ("arrow", {"form": "encoded", "threads": cores}), ("posix", {"form": "encoded", "threads": cores}),
             ("dali", {"reader": "external", "num_threads": cores})]
    for backend, raw in paths:
        cls = backend_class(backend)
        label = f"{backend} " + " ".join(f"{k}={v}" for k, v in raw.items())
        available, why = cls.available()
        if not available:
            rates.append((label, why))
            continue
        try:
            loader = configured_loader(backend, config, dataset, cls.Settings(**raw),
                                       device=resolve_device("cpu"))
            if job.transform is not None:
                loader.sample_transform = SampleTransform(job.transform, job.transform_name, job.image_size)
            loader.prepare()
            rates.append((label, timed(forever(loader), BATCHES)))
            loader.close()
        except LoadoptError as exc:
            rates.append((label, str(exc).splitlines()[0]))
    return rates


def ending(loader: Any, waited: float | None) -> list[str]:
    """The lines `loadopt measure` ends with for the DataLoader `loader` (`waited`: the share of its loop's time
    spent waiting for data): its pipeline on loadopt's paths, the fastest named."""
    job = job_pipeline(loader)
    if isinstance(job, str):
        return [f"loadopt's paths for this loop: not run: {job}"]
    rates = path_rates(job, lambda: loader)  # the script's own DataLoader, iterated again as it was made
    head = (f"this loop's pipeline on loadopt's paths ({job.dataset_name}, first "
            f"{len(job.dataset):,} samples; {job.described}; {job.image_size} px, batch {job.batch_size}), "
            f"loader-bound, {BATCHES} batches each:")
    base = rates[0][1]
    lines = [head]
    for label, rate in rates:
        if isinstance(rate, str):
            lines.append(f"  {label:<44} not run: {rate}")
        else:
            times = f"  {rate / base:.2f}x" if isinstance(base, float) and label != rates[0][0] else ""
            lines.append(f"  {label:<44} {rate:>10,.0f} samples/s{times}")
    measured = [(label, rate) for label, rate in rates[1:] if isinstance(rate, float)]
    if measured and isinstance(base, float):
        label, rate = max(measured, key=lambda item: item[1])
        backend = label.split()[0]
        lines.append(f"fastest for this pipeline: {label}, {rate / base:.2f}x your DataLoader: make_loader(dataset, "
                     f"backend={backend!r}, transform=<its transform before ToTensor>, augment='none', "
                     f"mean={job.mean}, std={job.std}, batch_size={job.batch_size})")
        if waited is not None:
            bound = "input-bound: a faster path shortens it" if waited >= 0.1 else \
                "not input-bound: a faster path would shorten it by that much at most"
            lines.append(f"the loop waited for data {waited:.0%} of its time, {bound}")
    return lines


def stall_of(metrics: Any) -> float | None:
    """The measured loop's share of time waiting for data, from its metrics."""
    value = getattr(metrics, "get", lambda *_: None)("stall_fraction")
    if isinstance(value, dict):
        value = value.get("median")
    return float(value) if isinstance(value, int | float | np.floating) else None

