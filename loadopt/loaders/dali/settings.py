"""The `dali` backend's knobs (`loaders.dali` in a config), checked."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DaliSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_threads: int = Field(2, ge=1)  # DALI's CPU threads (decode, resize, normalise)
    prefetch_queue_depth: int = Field(2, ge=1)  # batches DALI runs ahead of the consumer
    decoder: Literal["auto", "cpu", "mixed"] = "auto"  # auto: mixed (GPU) on a CUDA device, else cpu
    reader: Literal["external", "native"] = "external"  # external: loadopt's order; native: DALI's file reader
    source: Literal["images", "arrow"] = "images"  # the ImageFolder, or the Arrow `encoded` file
    read_threads: int = Field(2, ge=1)  # threads reading batches ahead (external reader)
    roi_decode: bool = True  # decode only the crop (plus the filter's margin), not the whole image
    normalise: Literal["dali", "device"] = "dali"  # float output: normalised by DALI, or uint8 + on the device
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    # Memory hints (0 / None: DALI's defaults).
    bytes_per_sample_hint: int = Field(0, ge=0)
    hw_decoder_load: float = Field(0.75, ge=0.0, le=1.0)  # mixed: share of the images for the HW decoder
    device_memory_padding: int | None = Field(None, ge=0)  # mixed: nvJPEG device buffer growth, bytes
    host_memory_padding: int | None = Field(None, ge=0)  # mixed: nvJPEG pinned buffer growth, bytes
