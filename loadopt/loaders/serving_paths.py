"""The built-in request paths (loaders/serving.py): torch's decoders, DALI's pipeline and a catalogue
pre-decoded in a loadopt conversion. Each delivers the eval recipe, as the loaders do."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loadopt.config_models import PipelineConfig
from loadopt.imaging.geometry import EVAL_CROP_FRACTION
from loadopt.loaders import transforms
from loadopt.loaders.serving import Payload, RequestPath
from loadopt.storage.dataset import Dataset

if TYPE_CHECKING:
    from loadopt.loaders.arrow_loader import ArrowLoader


class DecodedRequests(RequestPath):
    """The request's JPEG decoded on the host: PIL's decoder and resize (torch plain), or the fastest decoder
    with torch's resize (tuned), whole or only over the crop's region (libjpeg-turbo, `loadopt/_jpeg.c`)."""

    def __init__(self, label: str, pipeline: PipelineConfig, seed: int, decoder: str, resize: str,
                 region: bool) -> None:
        super().__init__(label, pipeline, seed)
        self.decoder, self.resize, self.region = decoder, resize, region

    def one(self, payload: Payload) -> torch.Tensor:
        image = self.new_image()
        # eval: the centre crop, no randomness (epoch and index do not matter)
        transforms.write_sample(payload, image.permute(2, 0, 1), self.decoder, self.resize, "eval", self.seed, 0, 0,
                                region=self.region, reduced_scale=self.pipeline.jpeg_scale == "reduced")
        return image


class DaliRequests(RequestPath):
    """Each dynamic batch's JPEGs fed to a DALI pipeline (`external_source`): decoded (`cpu`, or `mixed` on a
    GPU), the shorter side resized to size / 0.875 and the centre crop taken, as DALI's eval recipe."""

    per_batch = True

    def __init__(self, label: str, pipeline: PipelineConfig, seed: int, max_batch: int, threads: int,
                 decoder: str, device: torch.device) -> None:
        super().__init__(label, pipeline, seed)
        self.max_batch, self.threads, self.decoder, self.device = max_batch, threads, decoder, device
        self._pipe: Any = None

    def open(self, dataset: Dataset, progress: Callable[[int, int], None] | None = None) -> None:
        from nvidia.dali import Pipeline, fn, types

        size = self.pipeline.image_size
        gpu = self.decoder == "mixed"
        device_id = (self.device.index or 0) if gpu else None
        # Run synchronously: a request's batch is fed and run at once, nothing prefetched ahead of it.
        pipe = Pipeline(batch_size=self.max_batch, num_threads=self.threads, device_id=device_id, seed=self.seed,
                        prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        with pipe:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8)
            images = fn.decoders.image(encoded, device=self.decoder, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=round(size / EVAL_CROP_FRACTION),
                               interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.crop_mirror_normalize(images, crop=(size, size), dtype=types.UINT8, output_layout="HWC")
            pipe.set_outputs(images)
        pipe.build()
        self._pipe = pipe

    def batch(self, payloads: Sequence[Payload]) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch.torch_utils import to_torch_tensor

        assert self._pipe is not None, "open() builds the pipeline"
        self._pipe.feed_input("encoded", [np.frombuffer(p, dtype=np.uint8) for p in payloads])
        (out,) = self._pipe.run()
        return to_torch_tensor(out.as_tensor(), copy=True)

    def close(self) -> None:
        self._pipe = None


class CatalogueRequests(RequestPath):
    """A fixed catalogue pre-decoded in the arrow backend's conversion: the request carries a sample id, the
    image is its stored form's eval crop (copied from the mapped file, or decoded from it for the encoded form)."""

    def __init__(self, label: str, pipeline: PipelineConfig, seed: int, loader: ArrowLoader) -> None:
        super().__init__(label, pipeline, seed)
        self.loader = loader

    def open(self, dataset: Dataset, progress: Callable[[int, int], None] | None = None) -> None:
        self.loader.prepare(progress)

    def payload(self, dataset: Dataset, index: int) -> Payload:
        return index

    def one(self, payload: Payload) -> torch.Tensor:
        indices = np.asarray([payload], dtype=np.int64)
        slot = self.new_image().unsqueeze(0)
        filled = self.loader.filler.fill(slot, indices, self.loader.column.locate(indices), 0, None)
        if filled.failures:
            raise ValueError(filled.failures[0][1])
        return slot[0]

    def close(self) -> None:
        self.loader.close()
