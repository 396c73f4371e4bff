"""The job's own per-sample transform on the `dali` path: DALI's Python operator hands each batch to worker processes
(`crop_processes`), which decode, crop and transform its samples as every other path does, side by side.

DALI runs a Python operator in one thread of its own, under the GIL: a transform run there (the operator's per-sample
mode) ran one sample at a time whatever DALI's thread count, at about a third of what the same transform does in
two worker processes (benchmarks/user_transform.py). Here the operator copies the batch's bytes into a staging buffer
in shared memory, the workers write its pixels into a shared output slot, and the operator hands DALI a copy.
"""

from __future__ import annotations

import numpy as np
import torch

from loadopt.config_models import PipelineConfig
from loadopt.loaders import transforms
from loadopt.loaders.crop_processes import CropProcesses
from loadopt.loaders.ring import shared_empty
from loadopt.loaders.sample_transform import SampleTransform


class SampleWorkers:
    """`count` worker processes making a batch's samples (`__call__`, DALI's batch-mode Python operator) into HWC
    uint8 pixels; the samples that failed, by index, in `failures` (their pixels are zeros: the loader drops them)."""

    def __init__(self, pipeline: PipelineConfig, seed: int, transform: SampleTransform, count: int,
                 most_bytes: int) -> None:
        self.pipeline, self.seed, self.epoch = pipeline, seed, 0
        size, batch = pipeline.image_size, pipeline.batch_size
        self.out = shared_empty((1, batch, size, size, 3), torch.uint8).numpy()
        self.staging = shared_empty((max(1, most_bytes),), torch.uint8).numpy()
        self.transform = transform
        self.decoder = transforms.decoder_name("auto")
        self.workers = CropProcesses([self.out[0]], [self.staging], count, transform=transform)
        self.failures: dict[int, str] = {}

    def __call__(self, data: list[np.ndarray], index: list[np.ndarray]) -> list[np.ndarray]:
        indices = np.asarray([int(i[0]) for i in index], np.int64)
        lengths = np.asarray([len(d) for d in data], np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        if int(lengths.sum()) > len(self.staging):  # a batch larger than the staging: made here, one at a time
            return [self.made_here(d, int(i)) for d, i in zip(data, indices.tolist(), strict=True)]
        for start, blob in zip(starts.tolist(), data, strict=True):
            self.staging[start : start + len(blob)] = blob
        self.workers.send_decode(0, indices, np.zeros(len(indices), np.int32), starts, lengths, self.decoder,
                                 self.pipeline.augment, self.seed, self.epoch,
                                 self.pipeline.jpeg_scale == "reduced")
        failed = dict(self.workers.receive().failures)
        self.failures.update(failed)
        out = self.out[0]
        return [np.zeros_like(out[k]) if int(i) in failed else out[k].copy() for k, i in enumerate(indices.tolist())]

    def made_here(self, data: np.ndarray, index: int) -> np.ndarray:
        size = self.pipeline.image_size
        pixels = np.zeros((size, size, 3), np.uint8)
        try:
            transforms.write_sample(data.data, torch.from_numpy(pixels).permute(2, 0, 1), self.decoder, "torch",
                                    self.pipeline.augment, self.seed, self.epoch, index, transform=self.transform,
                                    reduced_scale=self.pipeline.jpeg_scale == "reduced")
        except Exception as exc:  # noqa: BLE001 - the sample's failure, reported by policy in the consumer
            from loadopt.errors import describe_sample_error

            self.failures[index] = describe_sample_error(exc)
        return pixels

    def close(self) -> None:
        self.workers.close()
