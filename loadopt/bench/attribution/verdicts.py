"""Bottleneck attribution: a one-sentence verdict per loader setting on which stage bounds
the job. The job's demand is batch_size / step time; a loader setting is shown against the ceiling of
what its backend declares it does (`Loader.work_kind`, outside backends included: JPEG decode; crop +
resize of stored whole frames for the decoded forms' whole-frame path; a memory copy of decoded centre
squares or tokens; the storage read for a backend that only reads, or when the cache is cold; the ceilings
are measured by `measure_ceilings`), and the verdict says which stage bounds it.
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel

from loadopt.loaders.base import WorkKind
from loadopt.machine import usable_cores
from loadopt.schema.ceilings import DECODERS, Ceilings, DecodeRates, Job, RunCeiling
from loadopt.schema.documents import Knobs, Recipe
from loadopt.schema.metrics import RepeatMetrics, RunMetrics, took_no_step

CEILING_OVERSHOOT = 1.1  # a run this far above its ceiling shows the ceiling was measured low
STALL_COMPUTE_BOUND = 0.05  # below this stall the accelerator, not the input path, sets the pace


class Bound(NamedTuple):
    """What bounds a run: its stage, the ceiling's name, its capacity in samples/s, the capacity in words
    and what would lift it."""

    stage: str
    name: str
    samples_per_s: float | None
    words: str
    lift: str


class Attribution(BaseModel):
    """What `attribute` finds: the ceiling a run is held to, what bounds the job, and the verdict's sentence."""

    ceiling: RunCeiling
    bottleneck: str
    text: str


class Held(NamedTuple):
    """A run held to its ceiling: the ceiling (marked unreliable where the run beat it) and the fraction of it
    the run reached (None where unreliable or not measured)."""

    ceiling: RunCeiling
    fraction: float | None


def finishing_stalls(loader_stall: float | None, finish_stall: float | None, wait_ms: float,
                     finish_ms: float) -> bool:
    """Whether the stall is the host finishing's rather than the loader's: from the harness's split of the
    accelerator's idle time where it has one (`loader_stall_fraction`, `finish_stall_fraction`), else
    (CUDA) where the batches arrive in time and finishing them takes far longer than waiting for them."""
    if loader_stall is not None and finish_stall is not None:
        return finish_stall > loader_stall
    return finish_ms > 3 * wait_ms


def _sample_bytes(metrics: RunMetrics | RepeatMetrics, key_bytes: str) -> float | None:
    from loadopt.bench.metrics import median

    nbytes, samples = median(metrics, key_bytes), median(metrics, "samples")
    return nbytes / samples if nbytes and samples else None


def _delivered_bytes(metrics: RunMetrics | RepeatMetrics) -> float | None:
    """Bytes of the batch tensors per delivered sample: what the host-to-device copy moved."""
    from loadopt.bench.metrics import median

    rate, seconds, samples = median(metrics, "h2d_gb_per_s"), median(metrics, "h2d_s"), median(metrics, "samples")
    return rate * 1e9 * seconds / samples if rate and seconds and samples else None


def stores_whole_frames(label: str, settings: Knobs | None, recipe: Recipe | None,
                        job: Job) -> bool:
    """Whether a setting crops and resizes stored whole frames on the host: its recorded recipe says so
    (`stored: whole frame <= N px`), else its settings (decoded, `frame` whole, or
    auto under `augment: train`). kvikio resizes its frames on the device: not the host's work."""
    backend = (label.split() or [""])[0]
    if backend == "kvikio" or job.kind == "tokens":
        return False
    if recipe:
        return str(recipe.get("stored", "")).startswith("whole frame")
    settings = settings or {}
    if settings.get("form") != "decoded":
        return False
    frame = settings.get("frame", "auto")
    return frame == "whole" or (frame == "auto" and job.augment == "train")


def _recorded_or_implied_recipe(label: str, settings: Knobs, recipe: Recipe | None,
                                job: Job) -> Recipe:
    """The run's recorded recipe, else what its settings imply (results written before runs recorded one)."""
    if recipe:
        return recipe
    if job.kind == "tokens":
        return {"kind": "tokens"}
    if stores_whole_frames(label, settings, None, job):
        return {"kind": "images", "stored": "whole frame"}
    decoded = "decoded" in label.split() or settings.get("form") == "decoded"
    return {"kind": "images", "stored": "centre square" if decoded else "source"}


def declared_work_kind(label: str, settings: Knobs | None, recipe: Recipe | None,
                       job: Job) -> str:
    """What bounds a run, as its backend declares it (`Loader.work_kind`, a `WorkKind` value): the backend is
    the label's first word, looked up in the registry (outside backends included); a backend no longer
    known here, or settings it no longer accepts, get what the recipe implies."""
    from pydantic import ValidationError

    from loadopt.loaders.base import work_kind_of_recipe
    from loadopt.loaders.registry import backend_class

    settings = settings or {}
    recipe = _recorded_or_implied_recipe(label, settings, recipe, job)
    try:
        cls = backend_class((label.split() or [""])[0])
        model = cls.Settings(**{k: v for k, v in settings.items() if k in cls.Settings.model_fields})
        return str(WorkKind(cls.work_kind(model, recipe)).value)
    except (KeyError, ValueError, TypeError, ValidationError):
        return work_kind_of_recipe(recipe).value


def _storage_stage(metrics: RunMetrics | RepeatMetrics, ceilings: Ceilings, job: Job, lift: str) -> Bound:
    """The storage read as a stage: its capacity in samples of what this run reads per sample."""
    storage = ceilings.storage.bytes_per_s
    per_sample = _sample_bytes(metrics, "bytes_read") or job.mean_sample_bytes
    if not storage or not per_sample:
        return Bound("fetch-bound", "storage read", None, "storage read capacity not measured", lift)
    rate = storage / per_sample
    return Bound("fetch-bound", f"storage read ({storage / 1e6:,.0f} MB/s)", rate,
                 f"the storage reads {storage / 1e6:,.0f} MB/s = {rate:,.0f} samples/s of {per_sample / 1e3:,.0f} KB",
                 lift)


def _local_storage(ceilings: Ceilings) -> bool:
    """Whether the storage ceiling was measured on local files (which a warm bench reads from the page
    cache), not on remote objects (no page cache: every read is the storage's)."""
    return ceilings.storage.name == "storage sequential read"


def _crop_resize_stage(ceilings: Ceilings) -> Bound:
    measured = ceilings.crop_resize
    rate = measured.samples_per_s
    workers = measured.workers if measured.workers is not None else usable_cores()
    side = f"<= {measured.max_side} px" if measured.max_side else "whole"
    words_ = (f"{workers} cores crop and resize {rate:,.0f} samples/s from stored frames {side} "
              f"(the shared crop plan + torch's antialiased resize)" if rate else "crop + resize capacity not measured")
    lift = ("a centre-crop stored form (frame: centre, the augment: eval recipe), fewer or lower-resolution "
            "stored pixels (a lower pipeline.max_side: another recipe) or resizing on the GPU (kvikio) "
            "lifts this bound")
    return Bound("prep-bound", f"crop + resize of stored frames x {workers} cores", rate, words_, lift)


def _copy_stage(metrics: RunMetrics | RepeatMetrics, ceilings: Ceilings) -> Bound:
    """Decoded pixels or tokens: a memory copy of what each delivered sample carries."""
    copy = ceilings.memcpy.bytes_per_s
    per_sample = _delivered_bytes(metrics)
    rate = copy / per_sample if copy and per_sample else None
    name = f"memory copy bandwidth ({copy / 1e9:,.1f} GB/s)" if copy else "memory copy bandwidth"
    words_ = (f"memory copies {rate:,.0f} samples/s of {per_sample / 1e3:,.0f} KB"
              if rate and per_sample else f"{name} (capacity not measured)")
    return Bound("copy-bound", name, rate, words_,
                 "uint8 batches (pipeline.dtype: uint8), fewer copies per batch or more threads lift this bound")


def _page_cache_stage(metrics: RunMetrics | RepeatMetrics, ceilings: Ceilings, job: Job) -> Bound:
    """A backend that only reads, warm and local: the stored bytes come from the page cache, a memory copy each."""
    copy = ceilings.memcpy.bytes_per_s
    per_sample = _sample_bytes(metrics, "bytes_read") or job.mean_sample_bytes
    rate = copy / per_sample if copy and per_sample else None
    name = f"page cache copy ({copy / 1e9:,.1f} GB/s)" if copy else "page cache copy"
    words_ = (f"the page cache copies {rate:,.0f} samples/s of {per_sample / 1e3:,.0f} KB read"
              if rate and per_sample else f"{name} (capacity not measured)")
    return Bound("copy-bound", name, rate, words_,
                 "a smaller stored form or fewer bytes read per sample lifts this bound (storage.cache: cold "
                 "adds the storage read)")


def _decode_stage(label: str, settings: Knobs, decode: DecodeRates, kind: str) -> Bound:
    """JPEG decode on the host, at the rate of the decoder this setting runs. No device decode ceiling is
    measured: the host's decode stands in for DEVICE_DECODE."""
    words = label.split()
    backend = words[0] if words else ""
    slow = settings.get("decoder") == "pil" or (
        backend == "torch" and "plain" in words and settings.get("decoder", "auto") == "auto")
    chosen = decode.rate("pil" if slow else "fast")
    stored = kind == WorkKind.STORED_JPEG_DECODE and bool(decode.rate("stored").samples_per_s)
    if stored:  # the encoded forms' JPEGs (restart markers): their own decode rate
        chosen = decode.rate("stored")
    if backend == "dali" and decode.rate("dali").samples_per_s and "mixed" not in words \
            and kind != WorkKind.DEVICE_DECODE:
        chosen = decode.rate("dali")  # DALI's CPU engine, measured on its own
    cores = decode.cores if decode.cores is not None else usable_cores()
    lift = "GPU decode (dali mixed) or a pre-decoded format (arrow --decoded) lifts this bound"
    fast = decode.rate("fast")
    if slow and (fast.samples_per_s or 0) > (decode.rate("pil").samples_per_s or 0):
        # never recommend a decoder measured slower
        lift = (f"a faster decoder (torch variant tuned: {fast.decoder} + torch resize, "
                f"{fast.samples_per_s:,.0f} img/s), GPU decode or a pre-decoded format lifts it")
    rate = chosen.samples_per_s
    what = f"{chosen.decoder} + {chosen.resize} resize" + (", stored JPEGs" if stored else "")
    words_ = f"{cores} cores decode {rate:,.0f} img/s ({what})" if rate else "decode capacity not measured"
    decoder = chosen.decoder if chosen.decoder is not None else "?"
    return Bound("prep-bound", f"decode {decoder}{' (stored JPEGs)' if stored else ''} x {cores} cores", rate,
                 words_, lift)


def _host_work_stage(metrics: RunMetrics | RepeatMetrics, label: str, ceilings: Ceilings, job: Job,
                     settings: Knobs, kind: str) -> Bound:
    """The ceiling of the work per sample the backend declares (`kind`, a `WorkKind` value)."""
    if kind == WorkKind.CROP_RESIZE:
        return _crop_resize_stage(ceilings)
    if kind in (WorkKind.PIXEL_COPY, WorkKind.TOKEN_GATHER):
        return _copy_stage(metrics, ceilings)
    if kind == WorkKind.IO and (job.cache == "cold" or not _local_storage(ceilings)):
        return _storage_stage(metrics, ceilings, job, "a faster tier or a smaller stored form lifts this bound")
    if kind == WorkKind.IO:
        return _page_cache_stage(metrics, ceilings, job)
    return _decode_stage(label, settings, ceilings.decode, kind)  # JPEG_DECODE, STORED_JPEG_DECODE, DEVICE_DECODE


def bounding_ceiling(metrics: RunMetrics | RepeatMetrics, label: str, ceilings: Ceilings, job: Job,
                     settings: Knobs | None, recipe: Recipe | None = None) -> Bound:
    """The ceiling that bounds a run, for the work the run's backend declares (`declared_work_kind`), or the
    host-to-device link, or (cold) the storage read, where that is the lower capacity."""
    settings = settings or {}
    stage = _host_work_stage(metrics, label, ceilings, job, settings,
                             declared_work_kind(label, settings, recipe, job))
    h2d, per_sample = ceilings.h2d.bytes_per_s, _delivered_bytes(metrics)
    if h2d and per_sample and (stage.samples_per_s is None or h2d / per_sample < stage.samples_per_s):
        # On a GPU the copy to the device is a stage of its own: the lower capacity bounds.
        rate = h2d / per_sample
        stage = Bound("transfer-bound", f"pinned h2d ({h2d / 1e9:,.1f} GB/s)", rate,
                      f"the host-to-device link moves {rate:,.0f} samples/s of {per_sample / 1e3:,.0f} KB",
                      "uint8 batches, smaller crops on the host or decoding on the GPU lift this bound")
    if job.cache == "cold":
        # Cold: the read from storage is a stage of its own; the lower of the two capacities bounds.
        read = _storage_stage(metrics, ceilings, job, "a faster tier, a warm page cache or a smaller stored form "
                              "(encoded JPEGs) lifts this bound")
        if read.samples_per_s and (stage.samples_per_s is None or read.samples_per_s < stage.samples_per_s):
            return read
    return stage


def attribute(run_metrics: RunMetrics | RepeatMetrics, backend_label: str, ceilings: Ceilings, job: Job,
              settings: Knobs | None = None, recipe: Recipe | None = None) -> Attribution:
    """The ceiling that bounds this loader setting and a one-sentence verdict on what bounds the job.
    `recipe`: the run's recorded recipe (what it stores decides which ceiling applies)."""
    from loadopt.bench.metrics import median

    stage, name, capacity, cap, lift = bounding_ceiling(run_metrics, backend_label, ceilings, job, settings, recipe)
    rate = median(run_metrics, "samples_per_s") or 0.0
    stall = median(run_metrics, "stall_fraction") or 0.0
    batches = median(run_metrics, "batches") or 1
    wait_ms = (median(run_metrics, "wait_s") or 0.0) / batches * 1000.0
    finish_ms = (median(run_metrics, "finish_s") or 0.0) / batches * 1000.0
    demand = job.demand_samples_per_s
    unit = "img/s" if job.kind == "images" else "samples/s"
    step = f"{job.step_ms:g} ms per batch of {job.batch_size}" if job.step_ms else "step time 0"
    need = f"the job needs {demand:,.0f} {unit} at {step}" if demand else \
        "the job asks as fast as possible (step time 0), so the input path bounds it by construction"
    of_ceiling = f" ({rate / capacity:.0%} of that ceiling)" if capacity else ""
    if capacity and rate > CEILING_OVERSHOOT * capacity:  # the ceiling was measured low: no fraction as fact
        of_ceiling = " (above that ceiling as measured: the ceiling is unreliable, see ceiling.reason)"
    if stall < STALL_COMPUTE_BOUND:
        bottleneck = "compute-bound"
        text = (f"compute-bound: the accelerator is busy {1 - stall:.0%} of the time; the loader delivers "
                f"{rate:,.0f} {unit} ({cap}); a faster input path would not speed this job up")
    elif not took_no_step(run_metrics) and finishing_stalls(
            median(run_metrics, "loader_stall_fraction"), median(run_metrics, "finish_stall_fraction"), wait_ms,
            finish_ms):  # the batches are there in time: finishing stalls (with no step, nothing waits on them)
        bottleneck = "finish-bound"
        # On a CPU-only machine the "device" is emulated on the host: its finishing competes with the loader.
        where = " (emulated on the host CPU here, sharing its cores with the loader)" if job.device == "cpu" else ""
        text = (f"finish-bound: batches arrive in time (wait {wait_ms:.1f} ms per batch) but copying and "
                f"normalising them on the device{where} takes {finish_ms:.1f} ms per batch, stalling {stall:.0%}; "
                f"{need}; uint8 batches (normalised in the model) and pinned, non-blocking copies lift this bound")
    elif capacity and demand and capacity >= demand and rate < 0.8 * capacity:
        bottleneck = "loader-bound"
        text = (f"loader-bound: {cap}, enough for the job ({need}), but this setting delivers {rate:,.0f} "
                f"{unit}{of_ceiling}, stalling {stall:.0%}; more workers/threads or deeper prefetch lift this bound")
    else:
        bottleneck = stage
        text = f"{stage}: {cap}, {need}; the loader delivers {rate:,.0f} {unit}{of_ceiling}; {lift}"
    if bottleneck not in ("compute-bound", "finish-bound") and finish_ms > wait_ms / 2:
        text += f"; copying and normalising on the device adds {finish_ms:.1f} ms per batch"
    if bottleneck != "compute-bound" and job.cache == "warm":
        # Warm runs say nothing of the storage path; no cold runs are added behind the user's back.
        text += "; warm page cache (storage.cache: cold adds the storage read)"
    return Attribution(ceiling=RunCeiling(name=name, samples_per_s=capacity), bottleneck=bottleneck, text=text)


def ceilings_summary(ceilings: Ceilings) -> str:
    """One line of what was measured, for the CLI."""
    parts = []
    if ceilings.memcpy.bytes_per_s:
        parts.append(f"memory copy {ceilings.memcpy.bytes_per_s / 1e9:,.1f} GB/s")
    if ceilings.storage.bytes_per_s:
        parts.append(f"storage read {ceilings.storage.bytes_per_s / 1e6:,.0f} MB/s")
    decode = ceilings.decode
    for key in DECODERS:
        measured = decode.rate(key)
        if measured.samples_per_s:
            what = f"{measured.decoder}{' (stored JPEGs, restart markers)' if key == 'stored' else ''}"
            parts.append(f"decode {what} {measured.samples_per_s:,.0f} img/s ({decode.cores} cores)")
    crop = ceilings.crop_resize
    if crop.samples_per_s:
        parts.append(f"crop + resize of stored frames {crop.samples_per_s:,.0f} samples/s ({crop.workers} cores)")
    if ceilings.h2d.bytes_per_s:
        parts.append(f"pinned h2d {ceilings.h2d.bytes_per_s / 1e9:,.1f} GB/s")
    if ceilings.compute.step_ms:
        parts.append(f"compute alone {ceilings.compute.step_ms:,.1f} ms/step")
    return ", ".join(parts)


def hold_to_ceiling(ceiling: RunCeiling, rate: float | None, busy: bool = False) -> Held:
    """The fraction of its ceiling a run reached; a run more than 10% above its ceiling gets no fraction
    but the ceiling marked unreliable, with the reason (a ceiling cannot be beaten: it was measured low;
    `busy`: the machine was busy while the ceilings were measured)."""
    capacity = ceiling.samples_per_s
    fraction = rate / capacity if capacity and rate is not None else None
    if rate is None or fraction is None or fraction <= CEILING_OVERSHOOT:
        return Held(ceiling, fraction)
    why = ("the machine was busy while it was measured" if busy else
           "the ceiling's measurement did not capture what this setting does")
    marked = ceiling.model_copy(update={
        "unreliable": True, "measured_fraction": fraction,
        "reason": f"the run delivered {rate:,.0f} samples/s, {fraction:.2f}x the ceiling measured "
                  f"({capacity:,.0f} samples/s): {why}"})
    return Held(marked, None)
