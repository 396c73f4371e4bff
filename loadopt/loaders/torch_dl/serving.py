"""The `torch` backend's request path: each request's JPEG decoded and resized on the host, as its loader does."""

from __future__ import annotations

import torch

from loadopt.config_models import PipelineConfig
from loadopt.loaders import transforms
from loadopt.loaders.serving import Payload, RequestPath


class DecodedRequests(RequestPath):
    """The request's JPEG decoded on the host: PIL's decoder and resize (torch plain), or the fastest decoder
    with torch's resize (tuned), whole or only over the crop's region (libjpeg-turbo, `loadopt._jpeg`)."""

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
