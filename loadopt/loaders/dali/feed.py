"""What the `dali` backend feeds its pipeline: each batch's encoded bytes and crop plan (`Prepared`,
made by `plan_batch` with the shared crop plan from each JPEG's header), read ahead by a thread pool and
handed to DALI's external source in order (`Feed`), or one sample at a time to find the files DALI
cannot decode (`SampleFeed`); and DALI's errors cut to one line.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from loadopt.config_models import PipelineConfig
from loadopt.errors import describe_sample_error
from loadopt.imaging.decode import simplejpeg
from loadopt.loaders import transforms


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

    if len(data) == 0:
        raise ValueError("empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(bytes(data))) as image:
            return image.size
    except Image.UnidentifiedImageError:  # its message names a BytesIO's address, not the file
        raise ValueError(f"not an image PIL can identify ({len(data):,} bytes, starting {bytes(data[:4])!r})") \
            from None


# What the external source hands DALI per batch: encoded bytes, slice anchors, slice shapes, crop starts, ends (for
# the job's own transform: encoded bytes and the samples' indices).
Columns = tuple[list[np.ndarray] | np.ndarray, ...]


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

    def columns(self, keep: slice | list[int] = slice(None), with_indices: bool = False) -> Columns:
        """What DALI's external source is handed; `with_indices`: the bytes and each sample's index only (the job's
        own transform crops by loadopt's plan and draws by the index)."""
        data = self.data[keep] if isinstance(keep, slice) else [self.data[k] for k in keep]
        if with_indices:
            return data, self.indices[keep].reshape(-1, 1)
        return data, self.anchor[keep], self.shape[keep], self.roi_start[keep], self.roi_end[keep]


def pil_refusal(data) -> str | None:
    """Why PIL (libjpeg-turbo for JPEGs) cannot decode these bytes whole, or None when it can."""
    from PIL import Image

    if len(data) == 0:
        return "empty file (0 bytes)"
    try:
        with Image.open(io.BytesIO(bytes(data))) as image:
            image.load()
    except Image.UnidentifiedImageError:  # its message names a BytesIO's address, not the file
        return f"not an image PIL can identify ({len(data):,} bytes, starting {bytes(data[:4])!r})"
    except Exception as exc:  # noqa: BLE001 - whatever PIL raises is the sample's refusal
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def plan_batch(indices: np.ndarray, epoch: int, encoded: Callable[[int], np.ndarray], pipeline: PipelineConfig,
               seed: int, roi_decode: bool, refused: dict[int, str] | None = None) -> Prepared:
    """Read a batch (`encoded(index)`: a sample's stored bytes) and plan each sample's crop with the shared
    crop plan (in a reader thread). A sample that cannot be read or whose header cannot be parsed is a failure,
    and so is one in `refused` (index -> why: screened before DALI may see it)."""
    size = pipeline.image_size
    kept, data, rows, failures, nbytes = [], [], [], [], 0
    for index in indices.tolist():
        if refused and index in refused:  # never handed to DALI
            failures.append((index, refused[index]))
            continue
        try:
            blob = encoded(index)
            nbytes += len(blob)
            if len(blob) == 0:  # said as it is (PIL's error would name a BytesIO's address)
                failures.append((index, "empty file (0 bytes)"))
                continue
            width, height = image_size(blob)
        except Exception as exc:  # noqa: BLE001 - reported by policy in the consumer (a storage failure is raised)
            failures.append((index, describe_sample_error(exc)))
            continue
        (left, top, right, bottom), flip = transforms.plan(width, height, pipeline.augment, seed, epoch, index)
        y0 = x0 = 0
        y1, x1 = height, width
        if roi_decode:  # the slice holds the crop and the pixels the antialiasing filter reads around it
            margin = math.ceil(max(right - left, bottom - top) / size) + 1
            y0, x0 = max(0, math.floor(top) - margin), max(0, math.floor(left) - margin)
            y1, x1 = min(height, math.ceil(bottom) + margin), min(width, math.ceil(right) + margin)
        kept.append(index)
        data.append(blob)
        # A flip is the crop's columns taken right to left: DALI's resize mirrors an ROI whose start
        # is past its end, in the same pass (no separate mirror over the output).
        x_start, x_end = (right - x0, left - x0) if flip else (left - x0, right - x0)
        rows.append((y0, x0, y1 - y0, x1 - x0, top - y0, x_start, bottom - y0, x_end))
    table = np.asarray(rows, dtype=np.float64).reshape(-1, 8)
    return Prepared(np.asarray(kept, dtype=np.int64), data, table[:, 0:2].astype(np.int32),
                    table[:, 2:4].astype(np.int32), table[:, 4:6].astype(np.float32),
                    table[:, 6:8].astype(np.float32), failures, nbytes)


class Feed:
    """The external source's callback: the planned batches in order, read `ahead` batches early.

    Batches whose every sample failed before DALI (unreadable header) are never fed; the consumer
    skips them too, so the n-th DALI output is the n-th fed batch."""

    def __init__(self, prepare: Callable[[np.ndarray], Prepared] | None, batches: Sequence[np.ndarray],
                 pool: ThreadPoolExecutor | None, ahead: int, with_indices: bool = False) -> None:
        self.prepare, self.batches, self.pool, self.ahead = prepare, batches, pool, ahead
        self.with_indices = with_indices  # bytes and the samples' indices (`Prepared.columns`)
        self.futures: dict[int, Future[Prepared]] = {}
        self.cursor = 0  # the next batch DALI gets

    @classmethod
    def of_prepared(cls, prepared: list[Prepared], with_indices: bool = False) -> Feed:
        """A feed of batches already read and planned: it only hands them out (no pool, nothing ahead)."""
        feed = cls(None, [p.indices for p in prepared], None, ahead=0, with_indices=with_indices)
        for k, batch in enumerate(prepared):
            feed.futures[k] = Future()
            feed.futures[k].set_result(batch)
        return feed

    def get(self, k: int) -> Prepared:
        if self.pool is not None and self.prepare is not None:
            for j in range(k, min(k + self.ahead + 1, len(self.batches))):
                if j not in self.futures:
                    self.futures[j] = self.pool.submit(self.prepare, self.batches[j])
        return self.futures[k].result()

    def forget(self, k: int) -> None:
        self.futures.pop(k, None)  # DALI has consumed batch k: its buffers may go

    def __call__(self) -> Columns:
        while self.cursor < len(self.batches):
            prepared = self.get(self.cursor)
            self.cursor += 1
            if len(prepared.indices):
                return prepared.columns(with_indices=self.with_indices)
        raise StopIteration


class SampleFeed:
    """A feed of single-sample batches, to find which samples of a failed batch DALI cannot decode."""

    def __init__(self, prepared: Prepared, positions: list[int], with_indices: bool = False) -> None:
        self.prepared, self.positions, self.with_indices = prepared, list(positions), with_indices
        self.fed: list[Columns] = []

    def __call__(self) -> Columns:
        if not self.positions:
            raise StopIteration
        columns = self.prepared.columns([self.positions.pop(0)], self.with_indices)
        self.fed.append(columns)  # no_copy: DALI reads these arrays after the call returns
        return columns
