"""The `dali` backend's request path: each dynamic batch's JPEGs run through a DALI eval pipeline."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from loadopt.config_models import PipelineConfig
from loadopt.imaging.geometry import EVAL_CROP_FRACTION
from loadopt.loaders.serving import Payload, RequestPath
from loadopt.storage.dataset import Dataset


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
