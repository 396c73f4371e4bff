"""DALI's pipeline for the `dali` backend: the graph it runs on each batch, and running it.

`reader: external`: the batches `dali_feed.Feed` hands over (encoded bytes, the slice to decode, the crop
in it) are decoded over the slice only (`decoders.image_slice`), resized over the crop (linear,
antialiased; a flip is a mirrored ROI) and, as configured, normalised to NCHW float or kept uint8.
`reader: native`: DALI's own file reader, random crop decoder and shards (`NativeFiles`).
On a GPU the decoder is `mixed` (nvImageCodec; the hardware JPEG decoder where there is one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import NotRequired, TypedDict

from loadopt.config_models import PipelineConfig
from loadopt.imaging.geometry import EVAL_CROP_FRACTION
from loadopt.loaders.dali.feed import Columns
from loadopt.loaders.sample_transform import SampleTransform
from loadopt.loaders.transforms import decoder_name, write_sample

if TYPE_CHECKING:
    from loadopt.loaders.dali.settings import DaliSettings


class DecodeArgs(TypedDict):
    """The arguments this backend gives DALI's image decoders (`fn.decoders.*`)."""

    device: str  # "cpu" or "mixed"
    output_type: Any  # DALI's types.RGB (DALI builds its types at run time: mypy takes them as Any)
    hw_decoder_load: NotRequired[float]  # mixed only, as the padding hints (unset: DALI's defaults)
    device_memory_padding: NotRequired[int]
    host_memory_padding: NotRequired[int]


@dataclass(frozen=True)
class NativeFiles:
    """What DALI's own file reader reads (`reader: native`): local files, this rank's contiguous shard."""

    files: list[str]
    shard_id: int
    num_shards: int


@dataclass(frozen=True)
class DaliGraph:
    """The settings a DALI pipeline is built from; `build` makes one, `run` takes a batch out of it."""

    settings: DaliSettings
    pipeline: PipelineConfig
    decoder: str  # "cpu" or "mixed" (resolved from `auto`)
    device: torch.device
    seed: int
    # The job's own per-sample transform: each sample then made by loadopt's decode, crop and the transform in
    # DALI's Python operator (`python_function`), the same pixels as every other path; DALI batches and finishes.
    transform: SampleTransform | None = None
    # With the transform: each batch made by worker processes (`dali.workers.SampleWorkers`, DALI's batch-mode
    # Python operator); None: one sample at a time in DALI's Python operator (`sample_maker`).
    batch_maker: Callable[[list[np.ndarray], list[np.ndarray]], list[np.ndarray]] | None = None

    def normalised(self) -> bool:
        """Whether DALI normalises (float output), rather than the device finishing uint8 pixels."""
        return self.pipeline.dtype == "float32" and self.settings.normalise == "dali"

    def build(self, source: Callable[[], Columns] | None, epoch: int, depth: int | None = None,
              native: NativeFiles | None = None) -> Any:
        """A built pipeline over `source` (the external reader's feed), or over `native` files."""
        from nvidia.dali import Pipeline, fn, types

        s, size = self.settings, self.pipeline.image_size
        gpu = self.decoder == "mixed"
        device_id = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if gpu else None
        pipe = Pipeline(batch_size=self.pipeline.batch_size, num_threads=s.num_threads, device_id=device_id,
                        prefetch_queue_depth=depth or s.prefetch_queue_depth, seed=self.seed + 7919 * epoch,
                        bytes_per_sample=s.bytes_per_sample_hint or 0)
        decode_args: DecodeArgs = {"device": self.decoder, "output_type": types.RGB}
        if gpu:
            decode_args["hw_decoder_load"] = s.hw_decoder_load
            if s.device_memory_padding is not None:
                decode_args["device_memory_padding"] = s.device_memory_padding
            if s.host_memory_padding is not None:
                decode_args["host_memory_padding"] = s.host_memory_padding
        with pipe:
            if native is not None:
                images, labels = self._native_graph(fn, types, decode_args, native)
                mirror = fn.random.coin_flip() if self.pipeline.augment == "train" else 0
                crop = (size, size)
            elif self.transform is not None:
                data, index = fn.external_source(source=source, num_outputs=2, batch=True, no_copy=True,
                                                 dtype=[types.UINT8, types.INT64])
                if self.batch_maker is not None:
                    images = fn.python_function(data, index, function=self.batch_maker, batch_processing=True,
                                                num_outputs=1, output_layouts="HWC")
                else:
                    images = fn.python_function(data, index, function=self.sample_maker(epoch),
                                                batch_processing=False, num_outputs=1, output_layouts="HWC")
                labels, crop, mirror = None, None, 0
            else:
                data, anchor, shape, roi_start, roi_end = fn.external_source(
                    source=source, num_outputs=5, batch=True, no_copy=True,
                    dtype=[types.UINT8, types.INT32, types.INT32, types.FLOAT, types.FLOAT])
                images = fn.decoders.image_slice(data, anchor, shape, axis_names="HW", **decode_args)
                images = fn.resize(images, size=[size, size], roi_start=roi_start, roi_end=roi_end,
                                   roi_relative=False, interp_type=types.INTERP_LINEAR, antialias=True)
                labels, crop, mirror = None, None, 0  # flips are done by the resize (see `dali_feed.plan_batch`)
            if self.normalised():
                norm = {"dtype": types.FLOAT, "mean": [255 * m for m in self.pipeline.mean],
                        "std": [255 * v for v in self.pipeline.std]}
                images = fn.crop_mirror_normalize(images, mirror=mirror, output_layout=s.layout[1:], crop=crop, **norm)
            elif crop is not None or s.layout == "NCHW":
                images = fn.crop_mirror_normalize(images, mirror=mirror, output_layout=s.layout[1:], crop=crop,
                                                  dtype=types.UINT8)
            # else: uint8 HWC straight from the resize, one pass over the output fewer
            pipe.set_outputs(images, *([labels] if labels is not None else []))
        pipe.build()
        return pipe

    def sample_maker(self, epoch: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        """DALI's Python operator for the job's transform: a sample's bytes and index -> its HWC uint8 pixels, made
        as the other paths make them (`transforms.write_sample`, the fastest CPU decoder, torch's resize)."""
        pipeline, seed, transform = self.pipeline, self.seed, self.transform
        size, decoder = pipeline.image_size, decoder_name("auto")

        def make(data: np.ndarray, index: np.ndarray) -> np.ndarray:
            pixels = np.empty((size, size, 3), np.uint8)
            write_sample(data.data, torch.from_numpy(pixels).permute(2, 0, 1), decoder, "torch",
                         pipeline.augment, seed, epoch, int(index[0]), transform=transform,
                         reduced_scale=pipeline.jpeg_scale == "reduced")
            return pixels

        return make

    def _native_graph(self, fn: Any, types: Any, decode_args: DecodeArgs, native: NativeFiles) -> tuple[Any, Any]:
        size = self.pipeline.image_size
        # The "label" is the dataset index: the consumer takes labels (and sizes) from the dataset.
        files, labels = fn.readers.file(
            files=native.files, labels=list(range(len(native.files))), shard_id=native.shard_id,
            num_shards=native.num_shards, random_shuffle=self.pipeline.shuffle, pad_last_batch=True,
            stick_to_shard=True, name="reader")
        if self.pipeline.augment == "train":
            images = fn.decoders.image_random_crop(files, random_area=[0.08, 1.0],
                                                   random_aspect_ratio=[3 / 4, 4 / 3], **decode_args)
            images = fn.resize(images, size=[size, size], interp_type=types.INTERP_LINEAR, antialias=True)
        else:
            images = fn.decoders.image(files, **decode_args)
            images = fn.resize(images, resize_shorter=round(size / EVAL_CROP_FRACTION),
                               interp_type=types.INTERP_LINEAR, antialias=True)
        return images, labels

    def run(self, pipe: Any) -> list[torch.Tensor]:
        """One batch out of `pipe`, as torch tensors viewing DALI's outputs."""
        from nvidia.dali.plugin.pytorch.torch_utils import to_torch_tensor

        # Mixed: outputs ordered on torch's current stream (no host sync); a CPU-only pipeline has no stream.
        stream = torch.cuda.current_stream(self.device) if self.decoder == "mixed" else None
        outputs = pipe.run(stream) if stream is not None else pipe.run()
        # A view of DALI's output through DLPack: DALI's dynamic executor never reuses memory still referenced.
        return [to_torch_tensor(out.as_tensor(), copy=False) for out in outputs]
