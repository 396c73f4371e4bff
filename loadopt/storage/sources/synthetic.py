"""A synthetic ImageNet-shaped JPEG dataset, generated deterministically into the cache.

Image `i` depends only on `(seed, i)`, so the bytes are the same across runs and worker counts. The
dataset is written into `<root>.tmp-resume` (locked by the process writing it; another process at the
same time writes its own `<root>.tmp-<pid>-<random>`) and renamed to `<root>` once its manifest is
written: only a root holding `manifest.json` counts as finished, an interrupted one is never used. An
interrupted generation resumes: the images it finished are logged (`.done`) and not made again.
The images mimic ImageNet's: sizes around `mean_width x mean_height` with varied aspect ratios, and
content with structure (gradients, shapes with their own textures) plus the fine texture it takes to
reach ImageNet's ~110 KB mean file size (and decode cost) at quality 90.

A `val` split, as ImageNet has, is generated beside it on first use (`synthetic-<key>-val<count>`):
`val_fraction x num_samples` images drawn by the same recipe from the indices after train's, so train's
files, key and fingerprint stay what they were and val shares no image with train.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import io
import json
import math
import multiprocessing
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Protocol

import fsspec
import numpy as np
from PIL import Image, ImageDraw

from loadopt.errors import DatasetError
from loadopt.files import cache_dir, is_no_space
from loadopt.storage.forms import integrity
from loadopt.storage.sources.imagefolder import ImageDataset
from loadopt.storage.sources.request import SourceRequest

GENERATOR_VERSION = 1  # bump whenever the image recipe or the layout changes
MANIFEST = "manifest.json"
DONE_LOG = ".done"  # in a resumable tmp folder: (index, size) int64 pairs of the images written
LOCK = ".lock"
STALE_SECONDS = 24 * 3600  # leftover tmp folders older than this are removed
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
_PARAMS = ("num_samples", "num_classes", "mean_width", "mean_height", "jpeg_quality", "seed")
SPLITS = ("train", "val")
DEFAULT_VAL_FRACTION = 0.1  # config.SyntheticSpec.val_fraction's default (specs without the field get it)
_AREA_SIGMA = 0.35  # lognormal spread of the image area
_ASPECT_SPAN = math.log(1.5)  # aspect ratio: log-uniform within [2/3, 3/2] x mean_width / mean_height
# A sine table from the C library (not numpy's CPU-dispatched SIMD sin) keeps the bytes the same on any CPU.
_SINE = np.array([math.sin(2 * math.pi * k / 1024) for k in range(1024)], dtype=np.float32)


class SyntheticSpecLike(Protocol):
    """What this module needs of `loadopt.config.SyntheticSpec`."""

    num_samples: int
    num_classes: int
    mean_width: int
    mean_height: int
    jpeg_quality: int
    seed: int

    def model_dump(self, *, mode: str = "python") -> dict[str, float]: ...  # every parameter is a number


def synthetic_key(spec: SyntheticSpecLike) -> str:
    """A 16-hex-digit digest of the generation parameters and `GENERATOR_VERSION`. `val_fraction` is left
    out: it sizes the val split only, which lives in a root of its own."""
    params = {k: v for k, v in spec.model_dump(mode="json").items() if k != "val_fraction"}
    blob = json.dumps({"generator_version": GENERATOR_VERSION, "spec": params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def val_samples(spec: SyntheticSpecLike) -> int:
    """Images in the val split: `val_fraction` of `num_samples` (0: no val split)."""
    return round(spec.num_samples * float(getattr(spec, "val_fraction", DEFAULT_VAL_FRACTION)))


def synthetic_root(spec: SyntheticSpecLike, cache_dir: Path, split: str = "train") -> Path:
    """Where the finished split lives: `<cache_dir>/datasets/synthetic-<key>` for train (its name is also
    the dataset fingerprint, unchanged since before val existed), `synthetic-<key>-val<count>` for val."""
    name = f"synthetic-{synthetic_key(spec)}"
    if split == "val":
        name += f"-val{val_samples(spec)}"
    elif split != "train":
        raise ValueError(f"the synthetic dataset has splits {', '.join(SPLITS)}, not {split!r}")
    return Path(cache_dir) / "datasets" / name


def ensure_synthetic(spec: SyntheticSpecLike, cache_dir: Path,
                     progress: Callable[[int, int], None] | None = None,
                     workers: int | None = None, split: str = "train") -> Path:
    """The finished root of `split` (`<split>/<class>/<n>.JPEG` + `manifest.json`), generated if missing.

    `progress(done, total)` is called as images complete (not at all when the dataset exists);
    `workers` processes generate it (default: one per CPU). Raises `OSError` naming the path when the
    cache folder cannot be written, `ValueError` for a split the dataset does not have.
    """
    root = synthetic_root(spec, cache_dir, split)
    if _finished(root):
        return root
    params = {name: int(getattr(spec, name)) for name in _PARAMS}
    if split == "val" and val_samples(spec) == 0:
        raise ValueError("the synthetic dataset has no val split (dataset.synthetic.val_fraction is 0)")
    # val takes the indices after train's: the same recipe, no image shared with train.
    indices = range(params["num_samples"]) if split == "train" else \
        range(params["num_samples"], params["num_samples"] + val_samples(spec))
    layout = (split, params["num_classes"], max(6, len(str(indices[-1]))))
    _remove_stale(root.parent)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp, lock = _claim_partial(root)
        if _finished(root):  # finished by another process while this one claimed a folder
            _release(tmp, lock)
            return root
    except OSError as exc:
        error = OSError(f"cannot create the synthetic dataset folder {root}.tmp-*: {exc}")
        error.errno = exc.errno
        raise error from exc
    try:
        sizes = _generate(params, layout, indices, tmp, progress, workers)
        for name in (DONE_LOG, LOCK):
            (tmp / name).unlink(missing_ok=True)
        files = [[_relpath(layout, i), sizes[k], i % params["num_classes"]] for k, i in enumerate(indices)]
        manifest = {"generator_version": GENERATOR_VERSION, "spec": spec.model_dump(mode="json"),
                    "num_samples": len(files), "total_bytes": sum(sizes), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        _publish(tmp, root)
    except BaseException as exc:
        if lock is not None and is_no_space(exc):  # a full disk: nothing partial left, not even to resume
            os.close(lock)
            lock = None
        _release(tmp, lock)
        raise
    if lock is not None:
        os.close(lock)  # after the rename: no other process generates into the folder as it moves
    return root


def _release(tmp: Path, lock: int | None) -> None:
    """Give up `tmp`: a private folder is removed, the resumable one keeps what it finished for the next run."""
    if lock is None:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.close(lock)


def _claim_partial(root: Path) -> tuple[Path, int | None]:
    """The folder to generate into: `<root>.tmp-resume`, locked (flock) by this process, with the images an
    interrupted run finished in it (its `DONE_LOG`), or a private `<root>.tmp-<pid>-<random>` when another
    process holds that lock (both then generate; the first to finish is kept)."""
    partial = root.with_name(f"{root.name}.tmp-resume")
    partial.mkdir(exist_ok=True)
    os.utime(partial)  # in use: not stale
    lock = -1
    try:
        lock = os.open(partial / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by another process (or the folder just moved into place as a finished dataset)
        if lock >= 0:
            os.close(lock)
        tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()
        return tmp, None
    return partial, lock


def _finished_before(tmp: Path, indices: range) -> dict[int, int]:
    """{index: size} of the images an interrupted run wrote completely into `tmp` (its `DONE_LOG`: int64
    (index, size) pairs appended once a chunk's files are closed; a torn last record is ignored)."""
    try:
        data = (tmp / DONE_LOG).read_bytes()
    except FileNotFoundError:
        return {}
    pairs = np.frombuffer(data[: len(data) // 16 * 16], dtype=np.int64).reshape(-1, 2)
    keep = (pairs[:, 0] >= indices.start) & (pairs[:, 0] < indices.stop)
    return dict(zip(pairs[keep, 0].tolist(), pairs[keep, 1].tolist(), strict=True))


def _finished(root: Path) -> bool:
    return (root / MANIFEST).is_file()


Layout = tuple[str, int, int]  # (split, num_classes, digits of a sample's number)


def _relpath(layout: Layout, index: int) -> str:
    split, num_classes, sample_digits = layout
    class_digits = max(3, len(str(num_classes - 1)))
    return f"{split}/class_{index % num_classes:0{class_digits}d}/{index:0{sample_digits}d}.JPEG"


def _remove_stale(datasets: Path) -> None:
    """Best effort: drop tmp/stale folders that interrupted generations left over a day ago."""
    cutoff = time.time() - STALE_SECONDS
    try:
        for entry in datasets.glob("synthetic-*.*-*"):
            if (".tmp-" in entry.name or ".stale-" in entry.name) and entry.stat().st_mtime < cutoff:
                _remove(entry)
    except OSError:
        pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(tmp: Path, root: Path) -> None:
    """Rename `tmp` to `root`; keep a dataset another process finished first, replace a broken one."""
    for _ in range(5):
        try:
            os.rename(tmp, root)
            return
        except OSError:
            if _finished(root):  # finished concurrently by someone else: theirs is identical
                shutil.rmtree(tmp, ignore_errors=True)
                return
            if not os.path.lexists(root):
                continue
        # `root` exists but is not a finished dataset (an old interrupted run): move it aside, drop it.
        trash = root.with_name(f"{root.name}.stale-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(root, trash)
        except FileNotFoundError:
            continue
        _remove(trash)
    raise OSError(f"cannot move the synthetic dataset {tmp} into place at {root}")


def _generate(params: dict[str, int], layout: Layout, indices: range, tmp: Path,
              progress: Callable[[int, int], None] | None, workers: int | None) -> list[int]:
    """Write the images `indices` into `tmp`; returns their file sizes, in the order of `indices`."""
    total = len(indices)
    for index in indices[: params["num_classes"]]:
        (tmp / _relpath(layout, index)).parent.mkdir(parents=True, exist_ok=True)
    finished = _finished_before(tmp, indices)
    todo = [i for i in indices if i not in finished] if finished else indices
    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    # Chunks of up to 256 images a job: a million images are ~4,000 jobs, not 30,000 round trips.
    step = max(1, min(256, math.ceil(len(todo) / (workers * 8))))
    jobs = [(params, layout, str(tmp), todo[start : start + step]) for start in range(0, len(todo), step)]
    sizes = [0] * total
    for index, size in finished.items():
        sizes[index - indices.start] = size
    done = len(finished)

    with open(tmp / DONE_LOG, "ab") as log:
        def collect(chunk: list[tuple[int, int]]) -> None:
            nonlocal done
            for index, size in chunk:
                sizes[index - indices.start] = size
            log.write(np.asarray(chunk, dtype=np.int64).tobytes())
            log.flush()
            done += len(chunk)
            if progress is not None:
                progress(done, total)

        if workers == 1 or len(jobs) <= 1:
            for job in jobs:
                collect(_write_chunk(job))
        else:
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else None)
            # concurrent.futures, not multiprocessing.Pool: Pool's terminate after a worker's error (a full
            # disk) was seen to hang for good joining its handler threads.
            with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context, initializer=_end_with_parent,
                                     initargs=(os.getpid(),)) as pool:
                futures = [pool.submit(_write_chunk, job) for job in jobs]
                try:
                    for future in as_completed(futures):
                        collect(future.result())
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)  # the chunks under way end; none starts
                    raise
    return sizes


def _end_with_parent(parent: int) -> None:
    """In a generating worker: the kernel ends it when the process that forked it dies (Linux's PR_SET_PDEATHSIG).
    A parent ended outright (SIGKILL, the OOM killer) otherwise leaves its workers waiting forever on a queue
    whose write end they hold themselves."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: such a parent's workers may linger
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request above
        os._exit(0)


def _write_chunk(job: tuple[dict[str, int], Layout, str, Sequence[int]]) -> list[tuple[int, int]]:
    params, layout, tmp, indices = job
    sizes = []
    for index in indices:
        with open(os.path.join(tmp, _relpath(layout, index)), "wb") as handle:
            sizes.append((index, handle.write(_render_jpeg(params, index))))
    return sizes


def _render_jpeg(params: dict[str, int], index: int) -> bytes:
    """The JPEG bytes of sample `index`; depends only on `params` and `index` (RNG seeded by both)."""
    rng = np.random.default_rng([params["seed"], index])
    width, height = _image_size(rng, params["mean_width"], params["mean_height"])
    buffer, pixels = io.BytesIO(), _render(rng, width, height)
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=params["jpeg_quality"])
    return buffer.getvalue()


def _image_size(rng: np.random.Generator, mean_w: int, mean_h: int) -> tuple[int, int]:
    """Area lognormal, aspect log-uniform around mean_w/mean_h; the sides average about the means."""
    span = _ASPECT_SPAN
    mu = -_AREA_SIGMA**2 / 4 - 2 * math.log(math.sinh(span / 2) / (span / 2))
    area = mean_w * mean_h * rng.lognormal(mu, _AREA_SIGMA)
    aspect = mean_w / mean_h * math.exp(rng.uniform(-span, span))
    width = min(max(round(math.sqrt(area * aspect)), 64), max(64, 3 * mean_w))
    height = min(max(round(math.sqrt(area / aspect)), 64), max(64, 3 * mean_h))
    return width, height


def _noise(rng: np.random.Generator, width: int, height: int, scale: float, channels: int = 1) -> np.ndarray:
    """Smooth noise of about unit std with features of about `scale` pixels, shape (h, w, channels)."""
    grid = rng.integers(0, 256, (math.ceil(height / scale) + 2, math.ceil(width / scale) + 2, channels),
                        dtype=np.uint8)
    small = Image.fromarray(grid if channels == 3 else grid[:, :, 0])
    out = (np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32) - 127.5) / 60
    return out if channels == 3 else out[:, :, None]


def _render(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """An (h, w, 3) uint8 image: gradient + blotches, shapes, and a texture mix per region."""
    x = np.arange(width, dtype=np.float32)[None, :, None]  # pixel coordinates
    y = np.arange(height, dtype=np.float32)[:, None, None]
    slopes = rng.uniform(-80, 80, (2, 3)).astype(np.float32)
    base = rng.uniform(50, 205, 3).astype(np.float32)
    base = base + slopes[0] * (x / width - 0.5) + slopes[1] * (y / height - 0.5)
    base = base + _noise(rng, width, height, rng.uniform(24, 64), 3) * rng.uniform(15, 35)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    regions = Image.new("L", (width, height), 0)  # which shape covers each pixel (0: background)
    draw, draw_regions = ImageDraw.Draw(image), ImageDraw.Draw(regions)
    num_shapes = int(rng.integers(3, 9))
    for region in range(1, num_shapes + 1):
        kind = int(rng.integers(0, 3))
        colour = tuple(int(c) for c in rng.integers(30, 226, 3))
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        rx, ry = rng.uniform(0.05, 0.35) * width, rng.uniform(0.05, 0.35) * height
        if kind == 2:
            angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 8))))
            radii = rng.uniform(0.4, 1.0, len(angles))
            corners = np.stack([cx + rx * radii * np.cos(angles), cy + ry * radii * np.sin(angles)], 1)
            draw.polygon(corners.ravel().tolist(), fill=colour)
            draw_regions.polygon(corners.ravel().tolist(), fill=region)
        else:
            box = (cx - rx, cy - ry, cx + rx, cy + ry)
            shape = "ellipse" if kind == 0 else "rectangle"
            getattr(draw, shape)(box, fill=colour)
            getattr(draw_regions, shape)(box, fill=region)
    # Texture layers (luma): white noise, fine and medium noise, an oriented grating; each region mixes
    # them with its own weights, so surfaces differ the way fur, foliage or fabric do.
    period, theta = rng.uniform(2.5, 6.0), rng.uniform(0, np.pi)
    turns = (math.cos(theta) / period) * x[:, :, 0] + (math.sin(theta) / period) * y[:, :, 0]
    layers = [rng.standard_normal((height, width, 1), dtype=np.float32),
              _noise(rng, width, height, rng.uniform(1.3, 2.0)),
              _noise(rng, width, height, rng.uniform(2.5, 5.0)),
              _SINE[((turns + rng.uniform(0, 1)) * 1024).astype(np.int64) & 1023][:, :, None]]
    weights = rng.uniform((10, 28, 8, 0), (30, 72, 40, 36), (num_shapes + 1, 4)).astype(np.float32)
    weights[:, 3] *= rng.random(num_shapes + 1) < 0.4  # a grating on some regions only
    labels = np.asarray(regions)
    pixels = np.asarray(image, dtype=np.float32)
    for j, layer in enumerate(layers):
        pixels += weights[labels, j][:, :, None] * layer
    pixels += _noise(rng, width, height, rng.uniform(1.5, 3.0), 3) * 12  # fine colour texture
    return np.clip(pixels, 0, 255).astype(np.uint8)


def from_manifest(root: Path, split: str) -> ImageDataset | None:
    """The synthetic dataset's listing from its manifest (no directory walk)."""
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    files = [f for f in manifest["files"] if f[0].startswith(split + "/")]
    if not files:
        return None
    labels = np.array([f[2] for f in files], dtype=np.int64)
    classes = [f[0].split("/")[1] for f in (files[int(i)] for i in np.unique(labels, return_index=True)[1])]
    return ImageDataset(
        root=str(root / split),
        fs=fsspec.filesystem("file"),
        paths=np.char.add(f"{root}/".encode(), np.array([f[0] for f in files], dtype=np.bytes_)),
        labels=labels,
        sizes=np.array([f[1] for f in files], dtype=np.int64),
        classes=classes,
        fingerprint=root.name,  # synthetic-<key> for train (as ever), synthetic-<key>-val<count> for val
        synthetic=True,
    )


def open_source(request: SourceRequest) -> ImageDataset:
    """The synthetic image set the config describes, generated into the cache on first use."""
    config, split, progress = request.config, request.split, request.progress
    try:
        root = ensure_synthetic(config.dataset.synthetic, cache_dir(), progress=progress, split=split)
    except ValueError as exc:  # a split it does not have
        raise DatasetError(f"{config.source}: dataset.synthetic: {exc}") from None
    except OSError as exc:
        if is_no_space(exc):  # the partial folder is already gone (synthetic.ensure_synthetic)
            spec = config.dataset.synthetic  # JPEGs of these images at quality 90: about 0.8 bytes a pixel
            needed = int(spec.num_samples * spec.mean_width * spec.mean_height * 0.8)
            raise integrity.no_space_error(cache_dir() / "datasets", needed, "the synthetic dataset") from None
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic dataset into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    dataset = from_manifest(root, split)
    if dataset is None:
        raise DatasetError(f"{root}: the synthetic dataset has no split {split!r}")
    return dataset
