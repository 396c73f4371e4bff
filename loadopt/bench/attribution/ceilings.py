"""The machine's ceilings, measured in the bench's own run, each a capacity of one stage
measured apart, quickly (a few seconds at most): memory copy bandwidth, storage sequential read with the
page cache evicted, decode + transform per core x usable cores (from memory, in worker processes as the
loaders run), crop + resize of stored whole frames (the decoded forms' train path, from memory, the same
way), pinned host-to-device bandwidth on CUDA, and compute alone (the accelerator's step on an
in-memory batch). Measured before the runs and again after them, the best kept (`keep_best`).
The verdicts hold each run to the ceiling of what it does.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch

from loadopt.bench.attribution.parallel import in_process_rate, rate_in_workers
from loadopt.config_models import Config
from loadopt.errors import ConfigError, StorageError
from loadopt.imaging.reencode import with_restarts
from loadopt.loaders import crops, transforms
from loadopt.loaders.sample_transform import SampleTransform
from loadopt.machine import usable_cores
from loadopt.schema.ceilings import (
    DECODERS,
    Bandwidth,
    BeforeAfter,
    Ceilings,
    ComputeAlone,
    CropResizeRate,
    DecodeRate,
    DecodeRates,
    Job,
    Measurement,
    StorageRead,
)
from loadopt.storage.dataset import Dataset
from loadopt.storage.tiers.pagecache import evict
from loadopt.storage.tiers.sequential import read_sequential

if TYPE_CHECKING:
    from loadopt.loaders.dali.loader import DaliLoader

_STORAGE_BUDGET_BYTES = 128 << 20  # enough for a sequential rate, small enough to read in ~1 s cold
CEILING_SECONDS_ENV = "LOADOPT_CEILING_SECONDS"
_CEILING_SECONDS = 1.0  # each decode and crop ceiling's timed window, unless the environment says otherwise
_DECODE_SAMPLES = 300
_CROP_FRAMES = 64  # stored frames the crop + resize ceiling cycles through (decoded once, ~10 MB at 512 px)


@functools.lru_cache(maxsize=1)
def memcpy_bandwidth(repeats: int = 5) -> float:
    """Bytes/s of one numpy.copyto of a buffer 8x the L3 cache, at most 1 GiB (median of `repeats`); a
    `$LOADOPT_CEILING_SECONDS` under 1 s scales the buffer down with it (at least 64 MiB), because allocating and
    first touching two such buffers, twice a bench, outlasted a small bench's runs (docs/performance/code-notes.md).

    Cached per process: a machine property, and tests run many benches in one process."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        l3 = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
    except (OSError, ValueError, KeyError):
        l3 = 32 << 20
    size = min(8 * l3, 1 << 30)
    size = max(min(size, 64 << 20), int(size * min(1.0, ceiling_seconds())))
    source, target = np.ones(size, np.uint8), np.empty(size, np.uint8)
    np.copyto(target, source)  # the first copy faults the pages in; it is not timed
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def storage_bandwidth(dataset: Dataset, budget_bytes: int = _STORAGE_BUDGET_BYTES) -> StorageRead:
    """Sequential read rate of a sample of the dataset's files, page cache evicted first.

    The files are read whole, so they are back in the page cache afterwards: a warm bench is not
    made cold by this measurement. Not local: a sample of `dataset.read` calls (no eviction)."""
    files = dataset.local_files()
    rng = np.random.default_rng(0)
    if not files:
        indices = rng.permutation(len(dataset))[:64]
        start, nbytes = time.perf_counter(), 0
        for i in indices:
            nbytes += len(dataset.read(int(i)))
            if time.perf_counter() - start > 2.0:
                break
        seconds = time.perf_counter() - start
        return StorageRead(name="storage read", bytes_per_s=nbytes / seconds if seconds > 0 else None, bytes=nbytes,
                           note="dataset.read of a sample of remote objects (no page cache to evict)")
    chosen: list[str] = []
    total = 0
    for i in rng.permutation(len(files)):
        size = os.path.getsize(files[i])
        if chosen and total + size > budget_bytes:
            break
        chosen.append(files[i])
        total += size
    # One file larger than the budget (a token corpus): evict and read its head only.
    evicted = _evict_head(chosen[0], budget_bytes) if total > budget_bytes else evict(chosen)
    # Buffered (not O_DIRECT): the files end up in the page cache, as the docstring says.
    nbytes, seconds, _ = read_sequential(chosen, 4 << 20, max_bytes=budget_bytes)
    return StorageRead(name="storage sequential read", bytes_per_s=nbytes / seconds if seconds > 0 else None,
                       bytes=nbytes, note=f"{len(chosen)} files, {evicted} evicted from the page cache first")


def _evict_head(path: str, length: int) -> int:
    """Evict only the first `length` bytes of `path`: the rest stays as warm as the bench left it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        os.posix_fadvise(fd, 0, length, os.POSIX_FADV_DONTNEED)
        return 1
    except OSError:
        return 0
    finally:
        os.close(fd)


def ceiling_seconds() -> float:
    """Each decode and crop ceiling's timed window: 1 s, or `$LOADOPT_CEILING_SECONDS` (shorter: a quicker
    bench and noisier ceilings, the memory copy's buffer scaled down too; the test suite, which runs a hundred
    tiny benches, uses 0.2 s)."""
    text = os.environ.get(CEILING_SECONDS_ENV, "").strip()
    if not text:
        return _CEILING_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.01 <= seconds <= 60:
        raise ConfigError(f"{CEILING_SECONDS_ENV}={text!r}: expected seconds between 0.01 and 60")
    return seconds


def decode_rates(config: Config, dataset: Dataset, workers: int | None = None) -> DecodeRates:
    """Decode + crop/resize/flip from memory, for PIL (PIL's resize: the `plain` path), the fastest decoder
    (torch's resize: `tuned`) and the same on the encoded forms' stored JPEGs (`stored`: with restart
    markers, `imaging.reencode.with_restarts`), measured the way the loaders run: `workers` processes at
    once (default: the usable cores), one intra-op thread each (`rate_in_workers`)."""
    if config.dataset.kind != "images":
        return DecodeRates(skipped="token samples are not decoded")
    size, augment = config.pipeline.image_size, config.pipeline.augment
    transform = SampleTransform.of_pipeline(config.pipeline)  # the job's own is part of each sample's work
    slot = torch.empty((size, size, 3), dtype=torch.uint8).permute(2, 0, 1)  # a ring slot's CHW view of HWC memory
    blobs = _decodable_samples(dataset, min(_DECODE_SAMPLES, len(dataset)), slot, augment, config.seed, transform)
    if not blobs:
        return DecodeRates(skipped="none of the first samples could be read and decoded")
    count = len(blobs)
    cores = usable_cores()
    workers = max(workers or cores, 1)
    stored = [with_restarts(blob) for blob in blobs]
    fast = transforms.decoder_name("auto")
    window = ceiling_seconds()

    def rate_of(decoder: str, resize: str, samples: list[bytes]) -> DecodeRate:
        def work(i: int) -> None:
            transforms.write_sample(samples[i % count], slot, decoder, resize, augment, config.seed, 0, i % count,
                                    transform=transform)

        try:
            rate = rate_in_workers(work, workers, window)["samples_per_s"]
            how = f"{workers} worker processes, one intra-op thread each"
        except (OSError, ValueError, RuntimeError):  # no fork here: one process, one thread, times the cores
            rate = in_process_rate(work, window) * cores
            how = f"one thread x {cores} cores (worker processes could not be started)"
        return DecodeRate(decoder=decoder, resize=resize, per_core=rate / cores, samples_per_s=rate, how=how)

    out = DecodeRates(cores=cores, workers=workers, pil=rate_of("pil", "pil", blobs),
                      fast=rate_of(fast, "torch", blobs), stored=rate_of(fast, "torch", stored))
    # DALI's own CPU engine: its rate per thread differs from PIL's and simplejpeg's. Not with the job's transform:
    # DALI then runs loadopt's decode and the transform in worker processes, held to the `fast` rate (which has it).
    if "dali" in config.loaders and config.pipeline.transform is None:
        out.dali = _guarded(DecodeRate, _dali_engine_rate, config, dataset, cores)
    return out


def _decodable_samples(dataset: Dataset, count: int, slot: torch.Tensor, augment: transforms.Augment,
                       seed: int, transform: SampleTransform | None = None) -> list[bytes]:
    """The first `count` samples that read and decode: a damaged file is the loaders' to report (by
    `on_error`), while a ceiling measured on it would fail in its worker processes or count errors as work."""
    blobs = []
    for i in range(count):
        try:
            blob = dataset.read(i)
            transforms.write_sample(blob, slot, "pil", "pil", augment, seed, 0, i, transform=transform)
        except StorageError:  # the storage failed, not this sample: the next reads would wait their retries too
            raise
        except Exception:  # noqa: BLE001 - any failure to read or decode leaves the sample out of the ceiling
            continue
        blobs.append(blob)
    return blobs


class _Inline:
    """A pool of one: `crops.crop_frames` maps its chunk in the calling thread (each measuring worker
    process is one loader thread's worth of work)."""

    map = staticmethod(map)


def crop_resize_rate(config: Config, dataset: Dataset, workers: int | None = None) -> CropResizeRate:
    """Stored whole frames -> training samples: the shared crop plan (RandomResizedCrop + flip on the
    source size, scaled into stored pixels) and the loaders' own crop/resize (`crops.crop_frames`), from
    frames in memory stored as the decoded forms store them (`imaging.frames.stored_frame`, longer side
    <= `pipeline.max_side`), a batch at a time, `workers` processes at once, one intra-op thread each
    (`rate_in_workers`): the most the decoded whole-frame paths can deliver on this machine."""
    from loadopt.imaging.frames import stored_frame

    if config.dataset.kind != "images":
        return CropResizeRate(skipped="token samples are not cropped")
    p = config.pipeline
    frames, dims = [], []
    for i in range(min(_CROP_FRAMES, len(dataset))):
        try:
            blob, dim = stored_frame(dataset.read(i), p.max_side)
        except StorageError:  # the storage failed, not this sample: the next reads would wait their retries too
            raise
        except Exception:  # noqa: BLE001 - a sample that cannot be read or decoded is the loaders' to report
            continue
        frames.append(np.frombuffer(blob, np.uint8))
        dims.append(dim)
    if not frames:
        return CropResizeRate(skipped="none of the first samples could be read and decoded")
    count, batch = len(frames), max(1, min(p.batch_size, len(frames)))
    dims_array, zeros = np.asarray(dims, np.int32), np.zeros(batch, np.int64)
    out = np.empty((batch, p.image_size, p.image_size, 3), np.uint8)

    def work(i: int) -> None:  # the i-th batch: frames cycled, a new epoch's plan each pass over them
        positions = (np.arange(batch) + i * batch) % count
        crops.crop_frames(out, positions, [frames[k] for k in positions], np.arange(batch), zeros,
                          dims_array[positions], p.augment, config.seed, i * batch // count, _Inline, 1)

    cores, window = usable_cores(), ceiling_seconds()
    workers = max(workers or cores, 1)
    try:
        measured = rate_in_workers(work, workers, window)
        rate, how = measured["samples_per_s"] * batch, f"{workers} worker processes, one intra-op thread each"
    except (OSError, ValueError, RuntimeError):  # no fork here: one process, one thread, times the cores
        rate, how = in_process_rate(work, window) * batch * cores, \
            f"one thread x {cores} cores (worker processes could not be started)"
    pixels = float(np.mean([h * w for h, w, _, _ in dims]))
    return CropResizeRate(name="crop + resize of stored frames", samples_per_s=rate, workers=workers, cores=cores,
                          frames=count, mean_frame_pixels=pixels, max_side=p.max_side, image_size=p.image_size,
                          augment=p.augment, how=how, primitive="loadopt.loaders.crops.crop_frames")


def _dali_engine_rate(config: Config, dataset: Dataset, cores: int) -> DecodeRate:
    from loadopt.loaders.registry import backend_class

    cls = backend_class("dali")
    available, reason = cls.available()
    if not available:
        return DecodeRate(skipped=reason)
    # Decode + crop alone: uint8 HWC straight from DALI's resize (no normalisation pass), the fastest
    # pipeline DALI runs here, so that every DALI setting stays within its ceiling.
    settings = cls.Settings(num_threads=1, prefetch_queue_depth=1, decoder="cpu", normalise="device", layout="NHWC")
    loader = cls(dataset, config.pipeline, settings, seed=config.seed)
    try:
        per_core, _ = cast("DaliLoader", loader).engine_rate(batches=3)  # backend_class names the base type
    finally:
        loader.close()
    return DecodeRate(decoder="dali cpu", resize="dali", per_core=per_core, samples_per_s=per_core * cores)


def copy_to_device_bandwidth(device: torch.device, pinned: bool = True, size: int = 256 << 20) -> float:
    """Bytes/s of host-to-device copies of `size` bytes from pinned (or pageable) memory, CUDA events."""
    source = torch.empty(size, dtype=torch.uint8)
    source = source.pin_memory() if pinned else source
    target = torch.empty_like(source, device=device)
    target.copy_(source, non_blocking=pinned)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        target.copy_(source, non_blocking=pinned)
    end.record()
    end.synchronize()
    return 5 * size / (start.elapsed_time(end) / 1000.0)


def h2d_bandwidth(device: torch.device) -> Bandwidth:
    if device.type != "cuda":
        return Bandwidth(skipped=f"device {device}: no host-to-device link to measure (the copy is emulated)")
    return Bandwidth(name="pinned h2d bandwidth", bytes_per_s=copy_to_device_bandwidth(device))


def compute_alone(config: Config, dataset: Dataset, device: torch.device) -> ComputeAlone:
    """The accelerator's step on a batch already on the device: what the job does with no loader."""
    from loadopt.bench.accelerator import make_accelerator

    p, w = config.pipeline, config.workload
    accelerator = make_accelerator(w.model, w.step_time_ms, len(dataset.classes), device)
    if config.dataset.kind == "tokens":
        inputs = torch.zeros((p.batch_size, p.seq_len), dtype=torch.int64, device=device)
    else:
        dtype = torch.uint8 if p.dtype == "uint8" else torch.float32
        inputs = torch.zeros((p.batch_size, 3, p.image_size, p.image_size), dtype=dtype, device=device)
    labels = torch.zeros(p.batch_size, dtype=torch.int64, device=device)
    accelerator.step(inputs, labels)  # warm-up (a real model's first step allocates)
    accelerator.drain()
    start, steps = time.perf_counter(), 0
    while steps < 3 and (steps == 0 or time.perf_counter() - start < 3.0):
        accelerator.step(inputs, labels)
        steps += 1
    accelerator.drain()
    step_s = (time.perf_counter() - start) / steps
    return ComputeAlone(name="compute alone", step_ms=step_s * 1000.0,
                        samples_per_s=p.batch_size / step_s if step_s > 0 else None)


Part = TypeVar("Part", bound=Measurement)  # one ceiling's measurement


def _guarded(kind: type[Part], fn: Callable[..., Part], *args: Any) -> Part:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a ceiling that cannot be measured must not stop the bench
        return kind(skipped=f"{type(exc).__name__}: {exc}".splitlines()[0])


def _memcpy() -> Bandwidth:
    """The memory copy ceiling, measured again (not the process's cached figure)."""
    return Bandwidth(name="memory copy bandwidth", bytes_per_s=memcpy_bandwidth.__wrapped__())


def _job(config: Config, dataset: Dataset, device: torch.device, compute: ComputeAlone) -> Job:
    """The job the runs are held against: its demand is a batch per step (the emulated one, or the model's)."""
    p, w = config.pipeline, config.workload
    step_ms = w.step_time_ms if w.model == "none" else compute.step_ms
    return Job(batch_size=p.batch_size, step_ms=step_ms, model=w.model, cache=config.storage.cache,
               demand_samples_per_s=p.batch_size / (step_ms / 1000.0) if step_ms else None,
               augment=p.augment, max_side=p.max_side, mean_sample_bytes=float(dataset.sizes.mean()),
               kind=config.dataset.kind, device=device.type)


def measure_ceilings(config: Config, dataset: Dataset, device: torch.device,
                     workers: int | None = None) -> Ceilings:
    """The machine's ceilings and the job's demand, measured now (a few seconds in all). `workers`: the
    decode ceiling's worker processes (the most any loader setting of the bench runs; default the cores)."""
    started = time.perf_counter()
    ceilings = Ceilings(
        memcpy=_guarded(Bandwidth, lambda: Bandwidth(name="memory copy bandwidth", bytes_per_s=memcpy_bandwidth())),
        storage=_guarded(StorageRead, storage_bandwidth, dataset),
        decode=_guarded(DecodeRates, decode_rates, config, dataset, workers),
        crop_resize=_guarded(CropResizeRate, crop_resize_rate, config, dataset, workers),
        h2d=_guarded(Bandwidth, h2d_bandwidth, device),
        compute=_guarded(ComputeAlone, compute_alone, config, dataset, device))
    ceilings.job = _job(config, dataset, device, ceilings.compute)
    ceilings.seconds = time.perf_counter() - started
    return ceilings


def _higher(before: Part, after: Part, value: Callable[[Part], float | None]) -> Part:
    """The better of two measurements of one ceiling, with both recorded."""
    first, second = value(before), value(after)
    best = before if second is None or (first is not None and first >= second) else after
    if first is None and second is None:
        return best
    return best.model_copy(update={"measured": BeforeAfter(before=first, after=second)})


def _bytes_rate(part: Bandwidth | StorageRead) -> float | None:
    return part.bytes_per_s


def _samples_rate(part: DecodeRate | CropResizeRate) -> float | None:
    return part.samples_per_s


def _best_decode(before: DecodeRates, config: Config, dataset: Dataset) -> DecodeRates:
    """Each decoder's higher rate of the two measurements (a decoder measured only once kept as it is)."""
    after = _guarded(DecodeRates, decode_rates, config, dataset, before.workers)
    update = {key: _higher(before.rate(key), after.rate(key), _samples_rate) for key in DECODERS
              if key in before.model_fields_set or key in after.model_fields_set}
    return before.model_copy(update=update)


def keep_best(ceilings: Ceilings, config: Config, dataset: Dataset) -> Ceilings:
    """The ceilings measured again after the runs; of each, the higher of the two measurements.

    A busy phase of a shared machine can only lower a measurement, so the higher one is the nearer to
    what the machine does; each keeps both values (`measured.before`, `measured.after`)."""
    started = time.perf_counter()
    best = ceilings.model_copy(update={
        "memcpy": _higher(ceilings.memcpy, _guarded(Bandwidth, _memcpy), _bytes_rate),
        "storage": _higher(ceilings.storage, _guarded(StorageRead, storage_bandwidth, dataset), _bytes_rate)})
    if ceilings.decode.skipped is None:
        best.decode = _best_decode(ceilings.decode, config, dataset)
    crop_before = ceilings.crop_resize
    if crop_before.model_fields_set and crop_before.skipped is None:
        crop_after = _guarded(CropResizeRate, crop_resize_rate, config, dataset, crop_before.workers)
        best.crop_resize = _higher(crop_before, crop_after, _samples_rate)
    best.seconds = (ceilings.seconds or 0.0) + time.perf_counter() - started
    best.kept = "the higher of two measurements, before and after the runs"
    return best


# -- attribution -----------------------------------------------------------------------------------
