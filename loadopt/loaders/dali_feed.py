"""What the `dali` backend feeds its pipeline: each batch's encoded bytes and crop plan (`Prepared`),
read ahead by a thread pool and handed to DALI's external source in order (`Feed`), or one sample at
a time to find the files DALI cannot decode (`SampleFeed`); and DALI's errors cut to one line.
"""

from __future__ import annotations

import io
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from loadopt.imaging.decode import simplejpeg


def dali_error(exc: BaseException) -> str:
    """The one informative line of a DALI error (its message carries the pipeline's Python stack)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if "encountered:" in lines:
        lines = lines[lines.index("encountered:") + 1 :]
    lines = [line for line in lines if not line.startswith(("Critical error", "Current pipeline object"))]
    return lines[0] if lines else type(exc).__name__


def image_size(data) -> tuple[int, int]:
    """(width, height) from the image header: simplejpeg for JPEGs, PIL for anything else."""
    if simplejpeg is not None and bytes(data[:2]) == b"\xff\xd8":
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            return width, height
        except ValueError:
            pass  # e.g. an unusual subsampling: PIL reads more headers
    from PIL import Image

    with Image.open(io.BytesIO(bytes(data))) as image:
        return image.size


@dataclass
class Prepared:
    """One batch ready for DALI: encoded bytes and, per sample, the slice to decode and the crop in it."""

    indices: np.ndarray  # the samples fed to DALI, in order
    data: list[np.ndarray]
    anchor: np.ndarray  # (n, 2) int32 (y, x) of the decoded slice
    shape: np.ndarray  # (n, 2) int32 (height, width) of the decoded slice
    roi_start: np.ndarray  # (n, 2) float32 (y, x) of the crop in the slice; x start > x end: flipped
    roi_end: np.ndarray
    failures: list[tuple[int, str]] = field(default_factory=list)
    bytes_read: int = 0

    def columns(self, keep: slice | list[int] = slice(None)) -> tuple:
        data = self.data[keep] if isinstance(keep, slice) else [self.data[k] for k in keep]
        return data, self.anchor[keep], self.shape[keep], self.roi_start[keep], self.roi_end[keep]


class Feed:
    """The external source's callback: the planned batches in order, read `ahead` batches early.

    Batches whose every sample failed before DALI (unreadable header) are never fed; the consumer
    skips them too, so the n-th DALI output is the n-th fed batch."""

    def __init__(self, prepare, batches: list[np.ndarray], pool: ThreadPoolExecutor, ahead: int) -> None:
        self.prepare, self.batches, self.pool, self.ahead = prepare, batches, pool, ahead
        self.futures: dict[int, Future] = {}
        self.cursor = 0  # the next batch DALI gets

    def get(self, k: int) -> Prepared:
        for j in range(k, min(k + self.ahead + 1, len(self.batches))):
            if j not in self.futures:
                self.futures[j] = self.pool.submit(self.prepare, self.batches[j])
        return self.futures[k].result()

    def forget(self, k: int) -> None:
        self.futures.pop(k, None)  # DALI has consumed batch k: its buffers may go

    def __call__(self) -> tuple:
        while self.cursor < len(self.batches):
            prepared = self.get(self.cursor)
            self.cursor += 1
            if len(prepared.indices):
                return prepared.columns()
        raise StopIteration


class SampleFeed:
    """A feed of single-sample batches, to find which samples of a failed batch DALI cannot decode."""

    def __init__(self, prepared: Prepared, positions: list[int]) -> None:
        self.prepared, self.positions = prepared, list(positions)
        self.fed: list[tuple] = []

    def __call__(self) -> tuple:
        if not self.positions:
            raise StopIteration
        columns = self.prepared.columns([self.positions.pop(0)])
        self.fed.append(columns)  # no_copy: DALI reads these arrays after the call returns
        return columns
