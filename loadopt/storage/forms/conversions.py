"""The dataset's conversions to a backend's format, in one place: which formats exist (`FORMATS`, and
the backend that reads each), what a conversion stores for a pipeline and a backend's settings
(`converted_form`: the form, the decoded frame, the pixel size; the ring backends resolve theirs here
too), where it lives, and building, reusing or verifying one (`convert`, what
`loadopt convert` runs; the backends' `prepare` calls the same format modules' `convert`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from loadopt.config_models import PipelineConfig
from loadopt.errors import ConfigError, DatasetError
from loadopt.imaging.geometry import EVAL_CROP_FRACTION
from loadopt.imaging.reencode import REENCODE_QUALITY
from loadopt.storage.dataset import Dataset
from loadopt.storage.forms import arrow_convert, arrow_format, raw_convert, raw_format, shard_work
from loadopt.storage.forms.arrow_format import Form
from loadopt.storage.forms.engine import LOCAL, ConvertEngine

# Of decoded conversions (auto: whole for train augmentation); of encoded ones, `whole` stores JPEGs bounded by
# pipeline.max_side (re-encoded where larger), the others the source's bytes.
FRAMES = ("auto", "whole", "centre")
MIN_DECODED_SIZE = 8  # as the backends' `decoded_size` (pydantic: ge=8)


# The formats a dataset converts to, each with the backend that reads it.
FORMATS: dict[str, str] = {"arrow": "arrow", "raw": "posix"}


@dataclass(frozen=True)
class ConvertedForm:
    """What a backend reads of a dataset: `form` (decoded, encoded, tokens or records), the `frame` (decoded: whole
    or centre; encoded: whole for JPEGs bounded by max_side; None otherwise), the `stored` form of the
    conversion (frames for whole decoded frames, reencoded for bounded JPEGs) and the pixel `size` (whole:
    the longer side's bound; centre: the square's side; None for the sources' own JPEGs and tokens)."""

    form: Literal["decoded", "encoded", "tokens", "records"]
    frame: Literal["whole", "centre"] | None
    stored: Form
    size: int | None

    def describe(self) -> str:
        if self.stored == "reencoded":
            return f"{self.form} <= {self.size}px (re-encoded q{REENCODE_QUALITY} where larger)"
        return self.form + (f" {self.frame} {self.size}px" if self.size else "")


def converted_form(pipeline: PipelineConfig, form: str, decoded_size: int | None, frame: str, tokens: bool,
                   where: str, records: bool = False) -> ConvertedForm:
    """The form a backend with these settings reads. Decoded, `frame` auto: whole frames (longer side <=
    pipeline.max_side, the JPEG paths' crop plan) for train augmentation, else a `decoded_size` centre
    square (default image_size / 0.875: the eval recipe). Encoded, `frame` whole: the JPEGs bounded by
    pipeline.max_side (FFCV's jpg input: a larger source re-encoded, `imaging.reencode`); auto or centre:
    the sources' own bytes. `where` names the size in the error. Records are stored
    whole, each record's bytes, whatever the form asked for (the ring backends deliver their first bytes)."""
    if records:
        return ConvertedForm("records", None, "records", None)
    if tokens:  # token corpora are stored as windows, whatever the form asked for
        return ConvertedForm("tokens", None, "tokens", None)
    if form == "encoded":
        if frame == "whole":
            return ConvertedForm("encoded", "whole", "reencoded", pipeline.max_side)
        return ConvertedForm("encoded", None, "encoded", None)
    if form != "decoded":
        raise ConfigError(f"form {form}: unknown (known: decoded, encoded)")
    if frame == "auto":
        frame = "whole" if pipeline.augment == "train" else "centre"
    if frame == "whole":
        return ConvertedForm("decoded", "whole", "frames", pipeline.max_side)
    if frame != "centre":
        raise ConfigError(f"frame {frame}: unknown (known: {', '.join(FRAMES)})")
    size = decoded_size or round(pipeline.image_size / EVAL_CROP_FRACTION)
    if size < pipeline.image_size:
        raise DatasetError(f"{where} {size} is smaller than pipeline.image_size {pipeline.image_size}")
    return ConvertedForm("decoded", "centre", "decoded", size)


def check_options(to: str, frame: str, decoded_size: int | None, shard_mib: float) -> None:
    """`loadopt convert`'s options, checked before anything is generated or read."""
    if to not in FORMATS:
        raise ConfigError(f"--to {to}: unknown format (known: {', '.join(FORMATS)})")
    if frame not in FRAMES:
        raise ConfigError(f"--frame {frame}: unknown (known: {', '.join(FRAMES)})")
    if decoded_size is not None and decoded_size < MIN_DECODED_SIZE:
        raise ConfigError(f"--size {decoded_size}: too small (at least {MIN_DECODED_SIZE} pixels)")
    if not shard_mib > 0:
        raise ConfigError(f"--shard-mib {shard_mib:g}: must be more than 0")


def conversion_path(to: str, dataset: Dataset, stored: Form, size: int | None,
                    shard_mib: float = raw_format.DEFAULT_SHARD_MIB) -> Path:
    """Where the conversion lives: the folder of its shards."""
    if to == "raw":
        return raw_format.raw_path(dataset, stored, size, shard_mib)
    return arrow_format.arrow_path(dataset, stored, size, shard_mib)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


@dataclass(frozen=True)
class Conversion:
    """What `convert` did: the conversion's path, its stored form, size on disk, the samples it skipped
    as unreadable (on_error: skip), whether the finished one was reused (else: the seconds it took), its shards
    and how many of them were kept from an earlier conversion of a source that changed since."""

    path: Path
    samples: int
    stored: Form
    nbytes: int
    skipped: int
    reused: bool
    seconds: float
    shards: int = 0
    kept: int = 0  # shards taken from an earlier conversion of the source (their source shards unchanged)
    data_at: str | None = None  # where the shards' data is when `path` holds the reference only (a remote home)


def convert(to: str, dataset: Dataset, form: ConvertedForm,
            shard_mib: float = raw_format.DEFAULT_SHARD_MIB, progress: Callable[[int, int], None] | None = None,
            on_error: str = "raise", force: bool = False, verify: bool = False,
            engine: ConvertEngine = LOCAL) -> Conversion:
    """Convert `dataset` to format `to` in `form`, or reuse the finished conversion. `force` rebuilds it;
    `verify` checks every chunk against its checksums and the source against the digest it recorded,
    reconverting when the source changed (the format modules' `convert`); `engine` writes the shards (this
    process, or a Ray cluster)."""
    if to not in FORMATS:
        raise ConfigError(f"{to}: unknown format (known: {', '.join(FORMATS)})")
    if len(dataset) == 0:
        raise DatasetError(f"{dataset.root}: the dataset has no samples")
    path = conversion_path(to, dataset, form.stored, form.size, shard_mib)
    finished = path / shard_work.MANIFEST  # written last: the conversion is finished
    existed, before = finished.exists(), _mtime(finished)
    start = time.perf_counter()
    if to == "raw":
        raw_convert.convert(dataset, form.stored, form.size, shard_mib, progress=progress, on_error=on_error,
                            force=force, verify=verify, engine=engine)
        skipped = len(raw_convert.open_conversion(dataset, form.stored, form.size, shard_mib).meta["skipped"])
    else:
        arrow_convert.convert(dataset, form.stored, form.size, shard_mib, progress=progress, on_error=on_error,
                              force=force, verify=verify, engine=engine)
        skipped = len(arrow_convert.open_conversion(dataset, form.stored, form.size, shard_mib).skipped)
    seconds = time.perf_counter() - start
    table = shard_work.read_manifest(path, f"the {to} conversion")["shard_table"]
    here = {f.name: f.stat().st_size for f in path.iterdir()}
    data_name = raw_format.shard_name if to == "raw" else arrow_format.shard_name
    elsewhere = [e["bytes"] for k, e in enumerate(table) if data_name(k) not in here]
    nbytes = sum(here.values()) + sum(elsewhere)  # a reference here, its shards' data on a remote home
    data = (raw_convert if to == "raw" else arrow_convert).data_home(dataset, path)
    return Conversion(path, len(dataset), form.stored, nbytes, skipped, existed and _mtime(finished) == before,
                      seconds, len(table), sum(1 for e in table if e.get("kept_from")),
                      data.where() if data is not None else None)
