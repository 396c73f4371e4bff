"""Moving batches to the device, and finishing them there.

On a GPU the copy runs on a side stream from (ideally pinned) host memory, timed with CUDA events
that are read back later, so timing never forces a synchronisation per step. On a CPU-only machine
the "device" is emulated for the harness: the copy goes into a preallocated destination buffer, which
costs what a host-to-device copy costs the host (a memory copy), and nothing is faked.

A GPU runs the copy and the finishing kernels queued on its streams, asynchronously to the host and
beside the step before: `EmulatedStream` is the emulated device's stream, one host thread that runs
each batch's copy and finishing in order while the host goes on to the next batch and the emulated step
runs. Its CPU is the host's (counted as CPU cost, as everything the process does); the accelerator is
idle only when a step has to wait for it (the harness says whose wait that was).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from loadopt.config_models import PipelineConfig

try:  # one-pass normalisation on the CPU, built at install where a C compiler is
    from loadopt import _native as native
except ImportError:  # pragma: no cover - built by `pip install`; torch's ops stay for installs without it
    native = None  # type: ignore[assignment]  # None where the optional module is absent


def resolve_device(requested: str | torch.device | None) -> torch.device:
    """`auto`/None: CUDA when there is one (under torchrun the process's own, `LOCAL_RANK`, as a job that never
    called `torch.cuda.set_device` expects), else CPU. Asking for CUDA without one is a user error."""
    import os

    from loadopt.errors import BackendUnavailable

    if requested is None or str(requested) == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local_rank = os.environ.get("LOCAL_RANK", "")
        if local_rank.isdigit() and int(local_rank) < torch.cuda.device_count():
            return torch.device("cuda", int(local_rank))
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(f"device {device}: CUDA is not available on this machine "
                                 f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    return device


@dataclass
class Elapsed:
    """A duration known now (host clock), or a CUDA event pair resolved only when asked."""

    value: float = 0.0
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def seconds(self) -> float:
        if self.events is None:
            return self.value
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


@dataclass
class TransferTiming:
    """One batch's host-to-device copy."""

    nbytes: int
    pinned: bool
    elapsed: Elapsed


class DeviceTransfer:
    """Copies batches to `device`; keeps the timing of the last copy in `last`.

    `emulate=True` on a CPU device copies into preallocated buffers (the harness's emulated device);
    `emulate=False` on a CPU device hands the tensors through untouched (training on the CPU).
    """

    def __init__(self, device: torch.device, emulate: bool = False) -> None:
        self.device = device
        self.emulate = emulate and device.type == "cpu"
        self.last = TransferTiming(0, False, Elapsed())
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._flip = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_device(self, *tensors: torch.Tensor) -> Sequence[torch.Tensor]:
        nbytes = sum(t.numel() * t.element_size() for t in tensors if t.device != self.device or self.emulate)
        pinned = all(_is_pinned(t) for t in tensors)
        if self._stream is not None:
            return self._to_cuda(tensors, nbytes, pinned)
        if not self.emulate:
            self.last = TransferTiming(0, pinned, Elapsed())
            return tensors
        start = time.perf_counter()
        # Two buffers per shape: the consumer may still hold the previous batch.
        self._flip ^= 1
        out = [self._buffer(tuple(t.shape), t.dtype, "copy").copy_(t) for t in tensors]
        self.last = TransferTiming(nbytes, pinned, Elapsed(time.perf_counter() - start))
        return out

    @contextmanager
    def device_work(self) -> Iterator[None]:
        """Around the copy and the finishing: the emulated device works on one host thread. It stands
        for an accelerator, so the host's other cores belong to the loader under test; torch's other
        intra-op threads would only spin against the loader's threads (more CPU per sample, a lower
        rate with the decoded arrow loader). A real device, or a CPU training loop, keeps torch's threads."""
        if not self.emulate:
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype, purpose: str = "scratch") -> torch.Tensor:
        """A reusable output buffer on the emulated device, paired with the current copy buffers (one pair
        per shape, dtype and `purpose`)."""
        return self._buffer(shape, dtype, purpose)

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype, purpose: str) -> torch.Tensor:
        # Two buffers per shape and purpose (the consumer may still hold the previous batch); a
        # different shape (the last, shorter batch) gets its own pair.
        key = (shape, dtype, purpose, self._flip)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer

    def _to_cuda(self, tensors, nbytes: int, pinned: bool):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        consumer = torch.cuda.current_stream(self.device)
        assert self._stream is not None  # a CUDA device's copy stream, made in __init__
        with torch.cuda.stream(self._stream):
            start.record()
            out = [t.to(self.device, non_blocking=True) for t in tensors]
            end.record()
        consumer.wait_stream(self._stream)
        for t in out:
            t.record_stream(consumer)  # the caching allocator must not reuse them under the consumer
        self.last = TransferTiming(nbytes, pinned, Elapsed(events=(start, end)))
        return out


class HostCopyDone:
    """The end of a batch's copy on the emulated device's stream, waited on as a CUDA event is
    (`synchronize()`): a backend that reuses its buffers (`HostBatch.borrowed`) waits on it before it
    writes into the buffer again."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


@dataclass
class StreamWork:
    """One piece of work queued on an `EmulatedStream`; `wait()` gives its result (or raises its error)."""

    run: Callable[[], Any]
    began_s: float = 0.0  # host clock, when the stream started it
    ended_s: float = 0.0  # host clock, when it was done
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class EmulatedStream:
    """The emulated device's stream: a host thread that runs the work queued on it in order, asynchronously
    to the thread that queued it (the copy and the finishing of each batch, as a GPU's copy stream and
    kernels run them). Started at the first `submit`; `close()` lets the queued work end and stops it."""

    def __init__(self, name: str = "loadopt-emulated-device") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[StreamWork | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, run: Callable[[], Any]) -> StreamWork:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        work = StreamWork(run)
        self._queue.put(work)
        return work

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _serve(self) -> None:
        while (work := self._queue.get()) is not None:
            work.began_s = time.perf_counter()
            try:
                work.result = work.run()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, never swallowed
                work.error = exc
            work.ended_s = time.perf_counter()
            work.done.set()


def _is_pinned(tensor: torch.Tensor) -> bool:
    if tensor.device.type != "cpu" or not torch.cuda.is_available():
        return False
    return tensor.is_pinned()


def finish_inputs(inputs: torch.Tensor, layout: str, normalised: bool, pipeline: PipelineConfig,
                  scratch=None) -> torch.Tensor:
    """Images shaped NCHW in `pipeline.memory_format` (channels-last memory: the NCHW view of NHWC),
    normalised on the device for float output.

    `scratch(shape, dtype, purpose)`, when given, returns a reusable output buffer (the emulated device's
    memory; on CUDA the caching allocator plays that part).
    """
    if layout in ("tokens", "records"):
        return inputs
    channels_last = pipeline.memory_format == "channels_last"
    float_out = not (pipeline.dtype == "uint8" or normalised)
    height, width = inputs.shape[1:3] if layout == "NHWC" else inputs.shape[2:4]
    if float_out and channels_last and height * width % 16 == 0:
        if layout == "NCHW":  # transpose the uint8 pixels: 4x fewer bytes to move than transposing floats
            inputs = _nhwc(inputs, scratch, "nhwc")
        return _normalise_channels_last(inputs, pipeline, scratch)
    if layout == "NHWC":
        inputs = inputs.permute(0, 3, 1, 2)
    if float_out:
        scale = 1.0 / (torch.tensor(pipeline.std, device=inputs.device).view(1, 3, 1, 1) * 255.0)
        shift = -torch.tensor(pipeline.mean, device=inputs.device).view(1, 3, 1, 1) / torch.tensor(
            pipeline.std, device=inputs.device).view(1, 3, 1, 1)
        shape = tuple(inputs.shape)
        out = scratch(shape, torch.float32) if scratch is not None else torch.empty(shape, device=inputs.device)
        # A conversion copy, then one fused multiply-add in place: far less CPU than mixed-dtype ops
        # (dynamic casting) or `.float()` into fresh memory (page faults on every batch), and less than a
        # separate `mul_` and `add_` (one pass over the floats instead of two). The output is
        # contiguous NCHW even from NHWC input: transposing during the copy costs less than running the
        # float ops over channels-last memory (measured: 4.8 against 11 ms a batch of 64 at 224 px).
        out.copy_(inputs)
        inputs = torch.addcmul(shift, out, scale, out=out)
    return _in_format(inputs, channels_last, scratch)


def _copy(view: torch.Tensor, scratch, purpose: str) -> torch.Tensor:
    """`view` copied into memory laid out as its shape (a scratch buffer on the emulated device)."""
    shape = tuple(view.shape)
    out = scratch(shape, view.dtype, purpose) if scratch is not None else torch.empty(shape, dtype=view.dtype,
                                                                                      device=view.device)
    return out.copy_(view)


def _nhwc(images: torch.Tensor, scratch, purpose: str) -> torch.Tensor:
    """Contiguous NHWC copy of NCHW `images`. Copied as a transpose of (C, H*W) matrices: torch's copy takes a
    faster path for that than for the 4-d permutation (about twice as fast on a uint8 batch of 64 at 224 px)."""
    n, c, h, w = images.shape
    if not images.is_contiguous():
        return _copy(images.permute(0, 2, 3, 1), scratch, purpose)
    out = scratch((n, h, w, c), images.dtype, purpose) if scratch is not None else torch.empty(
        (n, h, w, c), dtype=images.dtype, device=images.device)
    out.view(n, h * w, c).copy_(images.view(n, c, h * w).transpose(1, 2))
    return out


def _in_format(images: torch.Tensor, channels_last: bool, scratch) -> torch.Tensor:
    """NCHW-shaped `images` in channels-last or contiguous memory: itself when it already is, else one
    transposing copy."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if images.dim() != 4 or images.is_contiguous(memory_format=fmt):
        return images
    if channels_last:
        return _nhwc(images, scratch, "format").permute(0, 3, 1, 2)
    return _copy(images, scratch, "format")


def _normalise_channels_last(inputs: torch.Tensor, pipeline: PipelineConfig, scratch=None) -> torch.Tensor:
    """NHWC uint8 -> NCHW float32 normalised, in channels-last memory (what convolutions prefer): a plain
    conversion copy, then the per-channel scale and shift (one fused multiply-add) over rows of 48 floats
    (16 pixels: the three channels' factors tiled 16 times), which vectorise where a channel dimension
    of 3 does not. Equal to the NCHW path bit for bit (the same float op per element), and faster. On
    the CPU, `_native.normalise` does both in one pass where it was built (torch's conversion copy is a
    scalar loop), bit for bit the same.
    Needs H x W divisible by 16."""
    n, h, w, c = inputs.shape
    scale, shift = _channel_factors(tuple(pipeline.mean), tuple(pipeline.std))
    out = scratch((n, h, w, c), torch.float32) if scratch is not None else torch.empty((n, h, w, c),
                                                                                       device=inputs.device)
    if not (inputs.device.type == "cpu" and inputs.is_contiguous() and native is not None
            and native.normalise(out.numpy(), inputs.numpy(), scale[:3].tolist(), shift[:3].tolist())):
        out.copy_(inputs)
        rows = out.view(-1, 48)
        torch.addcmul(shift.to(inputs.device), rows, scale.to(inputs.device), out=rows)
    return out.permute(0, 3, 1, 2)


@functools.lru_cache(maxsize=8)
def _channel_factors(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel scale 1 / (255 std) and shift -mean / std in float32, tiled 16 times (48 floats): computed
    once per normalisation rather than per batch (a few small tensors a batch cost the consumer ~0.2 ms)."""
    scale = (1.0 / (torch.tensor(std) * 255.0)).repeat(16)
    shift = (-torch.tensor(mean) / torch.tensor(std)).repeat(16)
    return scale, shift
