"""The job's own per-sample transform (`pipeline.transform`, `make_loader(transform=...)`), run where each backend
makes its samples, with the same random draws for a sample on every backend, in any worker and after a resume.

Before each call Python's `random`, NumPy's global generator and torch's default generator are seeded from
(seed, epoch, sample index) (a stream of `transforms.sample_hash` apart from the crop's), so a transform written
for a DataLoader's worker (torchvision, timm, albumentations: they draw from those generators) draws the same
numbers for the same sample whichever process or thread runs it. Those generators are one per process: threads
of one process take turns (`_CALLS`), and worker processes each run their own.

A transform of (image, target) (`pipeline.transform_target`) is handed the sample's target, `{"label": int,
field: value, ...}` (the fields the batches carry), and returns both, so a detection job moves its boxes with its
crop. Where it runs in a worker process, the targets it made travel back with the batch's reply (`made`, `give`)
and the consumer puts them in the batch (`take`).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from loadopt.config_models import PipelineConfig
from loadopt.errors import LoadoptError, SampleProblem
from loadopt.loaders.transforms import mix64_int, sample_hash
from loadopt.named import import_named
from loadopt.storage.dataset import Dataset, SampleFields

# A sample's target as a transform of (image, target) returns it: (label, {field: value}).
Target = tuple[int, dict[str, Any]]
# Targets made by a transform, by (epoch, sample index): what a worker sends back with its batch.
Made = dict[tuple[int, int], Target]

# XORed into a sample's hash: the transform's draws are not the crop plan's (`transforms.sample_uniforms`).
TRANSFORM_STREAM = 0x6A09E667F3BCC908  # sqrt(2)'s fraction, as SHA-512's first word

_CALLS = threading.Lock()  # the generators are the process's: one seeded call at a time
os.register_at_fork(after_in_child=lambda: globals().__setitem__("_CALLS", threading.Lock()))


def transform_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of sample `index`'s transform in `epoch`: the same wherever the sample is made."""
    return mix64_int(int(sample_hash(seed, epoch, np.asarray([index], np.int64))[0]) ^ TRANSFORM_STREAM)


def seed_generators(word: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch's default (CPU) generator from one 64-bit word.
    The CPU generator's own `manual_seed`, not `torch.manual_seed`: that one also seeds every accelerator's, 100 us
    a call (a tenth of a RandAugment step), for generators a transform on the host never draws from."""
    random.seed(word)
    np.random.seed(word & 0xFFFFFFFF)
    torch.default_generator.manual_seed(word & 0x7FFFFFFFFFFFFFFF)


class SampleTargets:
    """Sample `index`'s target as a transform of (image, target) is handed it: `{"label": int, field: value}` for
    the fields `names` the batches carry, read from `dataset` where the transform runs (a worker has its copy)."""

    def __init__(self, dataset: Dataset, names: list[str]) -> None:
        self.dataset, self.names = dataset, list(names)

    def __call__(self, index: int) -> dict[str, Any]:
        target: dict[str, Any] = {"label": int(self.dataset.labels[index])}
        if self.names and isinstance(self.dataset, SampleFields):
            values = self.dataset.fields(np.asarray([index], np.int64), self.names)
            target.update({name: values[name][0] for name in self.names})
        return target


class SampleTransform:
    """A per-sample transform `function(image) -> image` named `name`, whose result must be `size` square pixels:
    a PIL image, a HWC uint8 array or a uint8 tensor (CHW or HWC). `takes`: whether it is handed a PIL image or
    the HWC uint8 array. Called as `transform(pixels, seed, epoch, index)`, it returns HWC uint8 pixels, or
    raises `SampleProblem` naming the transform, the sample and what went wrong."""

    def __init__(self, function: Callable[..., Any], name: str, size: int, takes: str = "pil",
                 with_target: bool = False) -> None:
        self.function, self.name, self.size, self.takes = function, name, size, takes
        # `with_target`: called `function(image, target)`, returning (image, target); the loader sets `targets`.
        self.with_target = with_target
        self.targets: SampleTargets | None = None
        self._made: Made = {}
        self._newest_epoch = 0

    @classmethod
    def of_pipeline(cls, pipeline: PipelineConfig, function: Callable[[Any], Any] | None = None
                    ) -> SampleTransform | None:
        """The pipeline's transform (`function` when given, named by `pipeline.transform`; else imported from
        that name), or None where it has none."""
        if pipeline.transform is None:
            return None
        if function is None:
            function = import_named(pipeline.transform, "pipeline.transform")
            if not callable(function):
                from loadopt.errors import ConfigError

                raise ConfigError(f"pipeline.transform: {pipeline.transform!r} is a {type(function).__name__}, "
                                  "not a function")
        return cls(function, pipeline.transform, pipeline.image_size, pipeline.transform_input,
                   pipeline.transform_target)

    def __call__(self, pixels: np.ndarray | Image.Image, seed: int, epoch: int, index: int) -> np.ndarray:
        given: Any = pixels
        if self.takes == "pil" and isinstance(pixels, np.ndarray):
            given = Image.fromarray(pixels)
        elif self.takes == "array" and isinstance(pixels, Image.Image):
            given = np.asarray(pixels.convert("RGB"))
        word = transform_seed(seed, epoch, index)
        target = (self.targets(index) if self.targets is not None else {"label": 0}) if self.with_target else None
        with _CALLS:
            seed_generators(word)
            try:
                out = self.function(given) if target is None else self.function(given, target)
            except Exception as exc:  # noqa: BLE001 - the user's function may fail any way: the sample's failure
                text = str(exc).splitlines()[0] if str(exc) else "no message"
                raise SampleProblem(f"pipeline.transform {self.name} raised {type(exc).__name__}: {text}") from None
        if target is None:
            return self.pixels(out)
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise SampleProblem(f"pipeline.transform {self.name} returned a {type(out).__name__}; a transform of "
                                "(image, target) returns (image, target)")
        pixels, made = self.pixels(out[0]), self.target(out[1])
        with _CALLS:
            self._keep({(epoch, index): made})
        return pixels

    def target(self, out: Any) -> Target:
        """The target a transform of (image, target) returned, as (label, the carried fields' plain values)."""
        if not isinstance(out, Mapping):
            raise SampleProblem(f"pipeline.transform {self.name} returned a {type(out).__name__} as the target; "
                                "return the dict it was handed ({'label': ..., field: ...})")
        names = self.targets.names if self.targets is not None else []
        missing = [key for key in ("label", *names) if key not in out]
        if missing:
            raise SampleProblem(f"pipeline.transform {self.name} returned a target without {missing[0]!r}")
        try:
            label = int(out["label"])
        except (TypeError, ValueError):
            raise SampleProblem(f"pipeline.transform {self.name} returned label {out['label']!r}, not an integer "
                                "class") from None
        return label, {name: plain(out[name]) for name in names}

    def _keep(self, made: Made) -> None:
        """Hold targets until the consumer takes them; those of epochs before the last two are dropped (a pass
        broken off never takes its last batches')."""
        newest = max((epoch for epoch, _ in made), default=self._newest_epoch)
        if newest > self._newest_epoch:
            self._newest_epoch = newest
            self._made = {key: value for key, value in self._made.items() if key[0] >= newest - 1}
        self._made.update(made)

    def made(self) -> Made:
        """The targets made here since last asked (a worker sends them with its batch's reply), handed over."""
        with _CALLS:
            made, self._made = self._made, {}
        return made

    def give(self, made: Made | None) -> None:
        """Targets a worker made (`made`), held for the consumer to take."""
        if made:
            with _CALLS:
                self._keep(made)

    def take(self, indices: np.ndarray, epoch: int) -> tuple[list[int], dict[str, list]]:
        """The labels and carried fields the transform made for samples `indices` of `epoch`, in their order."""
        names = self.targets.names if self.targets is not None else []
        labels: list[int] = []
        fields: dict[str, list] = {name: [] for name in names}
        with _CALLS:
            for index in indices.tolist():
                made = self._made.pop((epoch, int(index)), None)
                if made is None:
                    raise LoadoptError(f"pipeline.transform {self.name}: sample {index} of epoch {epoch} came "
                                       "without the target its transform made")
                labels.append(made[0])
                for name in names:
                    fields[name].append(made[1][name])
        return labels, fields

    def pixels(self, out: Any) -> np.ndarray:
        """What the transform returned as HWC uint8 pixels of the pipeline's size, or the one-line reason not."""
        if isinstance(out, Image.Image):
            array = np.asarray(out.convert("RGB") if out.mode != "RGB" else out)
        elif isinstance(out, torch.Tensor):
            array = out.detach().cpu().numpy()
            if array.ndim == 3 and array.shape[0] == 3 and array.shape[-1] != 3:
                array = array.transpose(1, 2, 0)
        elif isinstance(out, np.ndarray):
            array = out
        else:
            raise SampleProblem(f"pipeline.transform {self.name} returned a {type(out).__name__}; return the image: "
                                "a PIL image, a HWC uint8 array or a uint8 tensor")
        expected = (self.size, self.size, 3)
        if array.dtype != np.uint8 or array.shape != expected:
            raise SampleProblem(
                f"pipeline.transform {self.name} returned {array.dtype} pixels of shape {tuple(array.shape)}; "
                f"loadopt batches uint8 images of {self.size}x{self.size} (normalisation runs on "
                "the device from pipeline.mean and std: leave ToTensor and Normalize out)")
        return array

    def apply_to_slots(self, slots: np.ndarray, indices: np.ndarray, seed: int, epoch: int) -> list[tuple[int, str]]:
        """Transform each position k of `slots` ((B, size, size, 3) uint8, filled by loadopt's crop) as sample
        `indices[k]`, in place; the samples whose transform failed, with why (their positions left as they were)."""
        failures = []
        for k, index in enumerate(indices.tolist()):
            try:
                slots[k] = self(slots[k].copy(), seed, epoch, int(index))
            except SampleProblem as exc:
                failures.append((int(index), str(exc)))
        return failures


def plain(value: Any) -> Any:
    """A field's value as a transform returned it, in plain Python (a tensor or array as nested lists), so it
    crosses processes and collates the same on every path."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return value
