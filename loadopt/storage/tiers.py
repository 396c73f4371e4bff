"""Storage tiers: where a dataset is read from and what limits it is read under.

A tier is `local` (the dataset's own location, read as it is), a named profile from
`loadopt/storage/tiers.yaml`, linked as `configs/tiers.yaml` (figures of a typical device or network
store, emulated), or an inline spec in `storage.tier`. `base` points a tier at real storage (any
fsspec URL: a path, `http(s)://`, `s3://`, `memory://`); the emulated limits (bandwidth, latency,
concurrency, faults) are imposed on whatever is read through it by a wrapper filesystem
(storage/emulated.py), shared by every process that reads through the same tier instance.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import fsspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loadopt.errors import ConfigError, StorageError
from loadopt.files import read_yaml
from loadopt.schema import ConfigDump
from loadopt.storage.remote import RetryPolicy, is_local_fs, redact

TIERS_ENV = "LOADOPT_TIERS"
# Shipped inside the package so an installed wheel has it; configs/tiers.yaml in a checkout links here.
DEFAULT_TIERS_FILE = Path(__file__).resolve().parent / "tiers.yaml"


class TierSpec(BaseModel):
    """One tier: the real storage under it (`base`) and the limits emulated on top of it."""

    model_config = ConfigDict(extra="forbid")

    name: str = "local"
    base: str | None = None  # fsspec URL of the dataset root on the real storage; None: the dataset's own location
    bandwidth_mb_s: float | None = Field(None, gt=0)  # sustained, shared by all readers of the tier (MB = 10^6 B)
    latency_ms: float = Field(0.0, ge=0)  # per request; the mean when drawn from a distribution
    latency_distribution: Literal["fixed", "exponential", "lognormal"] = "fixed"
    max_concurrency: int | None = Field(None, ge=1)  # requests in flight at once (with latency: an IOPS cap)
    error_rate: float = Field(0.0, ge=0, le=1)  # fraction of read attempts that fail with an I/O error
    timeout_rate: float = Field(0.0, ge=0, le=1)  # fraction that hang for timeout_s, then time out
    timeout_s: float = Field(30.0, gt=0)
    price_per_tb_month: float | None = Field(None, ge=0)
    description: str = ""
    # fsspec options of `base` (s3fs: endpoint_url, key, secret, client_kwargs, ...); secrets are redacted.
    storage_options: dict[str, Any] = Field(default_factory=dict)
    retry: RetryPolicy = RetryPolicy()

    @model_validator(mode="after")
    def _rates(self) -> TierSpec:
        if self.error_rate + self.timeout_rate > 1:
            raise ValueError(f"error_rate + timeout_rate is {self.error_rate + self.timeout_rate:g}, at most 1")
        return self

    def emulates(self) -> bool:
        """Whether any limit or fault is imposed on the reads (else the real storage is read as it is)."""
        return (self.bandwidth_mb_s is not None or self.latency_ms > 0 or self.max_concurrency is not None
                or self.error_rate > 0 or self.timeout_rate > 0)

    def profile_mb_s(self, in_flight: float, request_bytes: float) -> float | None:
        """MB/s the tier's own figures deliver to `in_flight` requests of `request_bytes` each, whatever the
        storage under it: each takes the latency and its transfer, at most `max_concurrency` at once, all
        together at most `bandwidth_mb_s` (injected faults left out). None when the tier limits neither
        bandwidth nor latency (then its figures are the storage's own)."""
        if self.bandwidth_mb_s is None and self.latency_ms <= 0:
            return None
        if in_flight <= 0 or request_bytes <= 0:
            return 0.0
        served = min(in_flight, self.max_concurrency or in_flight)
        pipe = None if self.bandwidth_mb_s is None else self.bandwidth_mb_s * 1e6
        seconds = self.latency_ms / 1000.0 + (request_bytes / pipe if pipe else 0.0)
        rate = served * request_bytes / seconds
        return (rate if pipe is None else min(rate, pipe)) / 1e6

    def redacted(self) -> ConfigDump:
        """The spec as JSON-ready data, with credentials removed (for results and printing)."""
        return redact(self.model_dump(mode="json"))


def tiers_file(path: str | os.PathLike[str] | None = None) -> Path:
    """The tier profiles file: `path`, else $LOADOPT_TIERS, else the profiles shipped with loadopt."""
    return Path(path or os.environ.get(TIERS_ENV) or DEFAULT_TIERS_FILE).expanduser()


def load_tier_profiles(path: str | os.PathLike[str] | None = None) -> dict[str, TierSpec]:
    """The named tier profiles (`tiers:` mapping of name -> spec), validated; errors name file and key."""
    source = tiers_file(path)
    raw = read_yaml(source, "tier profiles file", f" (set {TIERS_ENV} to point at one)")
    profiles = raw.get("tiers") if isinstance(raw, dict) else None
    if not isinstance(profiles, dict):
        raise ConfigError(f"{source}: expected a `tiers:` mapping of profile name -> tier settings")
    out: dict[str, TierSpec] = {}
    for name, settings in profiles.items():
        if not isinstance(settings, dict):
            raise ConfigError(f"{source}: tiers.{name}: expected a mapping of tier settings")
        out[str(name)] = _validated({"name": str(name), **settings}, f"{source}: tiers.{name}")
    return out


def _validated(raw: dict[str, Any], where: str) -> TierSpec:
    try:
        return TierSpec(**raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(p) for p in error["loc"])
        what = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
        raise ConfigError(f"{where}{'.' + key if key else ''}: {what}, got {redact(error.get('input'))!r}") from None


def resolve_tier(tier: str | dict[str, Any] | TierSpec, profiles_path: str | os.PathLike[str] | None = None,
                 where: str = "storage.tier") -> TierSpec:
    """`"local"` -> the plain local tier; a profile name -> that profile; a mapping -> an inline spec.

    An inline mapping may name a profile to start from (`{profile: hdd, base: s3://...}`)."""
    if isinstance(tier, TierSpec):
        return tier
    if isinstance(tier, str):
        if tier == "local":
            return TierSpec()
        profiles = load_tier_profiles(profiles_path)
        if tier not in profiles:
            raise ConfigError(f"{where}: unknown tier {tier!r} (known: local, {', '.join(profiles)}; "
                              f"profiles from {tiers_file(profiles_path)})")
        return profiles[tier]
    if isinstance(tier, dict):
        raw = dict(tier)
        profile = raw.pop("profile", None)
        if profile is not None:
            start = resolve_tier(str(profile), profiles_path, f"{where}.profile").model_dump()
            raw = {**start, **raw}
        raw.setdefault("name", "inline" if profile is None else str(profile))
        return _validated(raw, where)
    raise ConfigError(f"{where}: expected local, a profile name or a mapping of tier settings, got {tier!r}")


def dataset_root(spec: TierSpec, path: str | None, where: str = "<config>") -> str | None:
    """Where the dataset is read from: `dataset.path`, or the tier's `base` (a relative `dataset.path`
    is then taken inside it); None: the synthetic dataset."""
    if path is not None:
        path = os.path.expanduser(path)
    if spec.base is None:
        return path
    base = os.path.expanduser(spec.base)
    if path is None:
        return base
    if "://" in path or os.path.isabs(path):
        raise ConfigError(f"{where}: dataset.path {redact(path)!r} and storage.tier.base {redact(base)!r} both name "
                          "the dataset's location; drop one, or make dataset.path relative to the base")
    return base.rstrip("/") + "/" + path


def tier_filesystem(spec: TierSpec, base_fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """`base_fs` read through tier `spec`: the emulating, retrying wrapper, or `base_fs` itself when the
    tier imposes nothing and the storage is a local disk (remote storage always gets retries and counters).

    Each call makes a new tier instance with its own shared state (bandwidth clock, concurrency slots,
    counters): hand the returned filesystem (or a dataset holding it) to the processes that should share
    the tier; it pickles by reference to that state, so spawned processes share it too."""
    from loadopt.storage.emulated import EmulatedFileSystem

    base_fs = tier_of(base_fs)  # a new tier over a cached dataset reads the storage, not the old tier's cache
    if isinstance(base_fs, EmulatedFileSystem):  # never stack two tiers: the outer spec applies to the real fs
        base_fs = base_fs.base_fs
    if not spec.emulates() and is_local_fs(base_fs):
        return base_fs
    return EmulatedFileSystem(spec, base_fs)


def tier_of(fs: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """The filesystem under a dataset's local shard cache (storage/shard_cache.py): its tier; `fs` itself
    when it reads through no cache."""
    from loadopt.storage.shard_cache import ShardCacheFileSystem

    return fs.tier if isinstance(fs, ShardCacheFileSystem) else fs


def tier_counters(fs: fsspec.AbstractFileSystem) -> dict[str, float] | None:
    """The counters of the tier `fs` reads through (requests, bytes, retries, injected faults, failed
    reads, ...), summed over every process that shares it; None when `fs` is not a tier wrapper. Under a
    shard cache, the cache's counters too (`cache_hit_reads`, `cache_fetched_bytes`, ...: `CacheCounters`)."""
    from loadopt.storage.emulated import EmulatedFileSystem

    if not isinstance(tier_of(fs), EmulatedFileSystem):
        return None
    return fs.counters()


def counters_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """What a run added to a tier's counters (None when there is no tier wrapper)."""
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0) for k in after}


def sum_counters(deltas: list[dict[str, float]]) -> dict[str, float]:
    """Counters of several runs (repeats) added up."""
    total: dict[str, float] = {}
    for delta in deltas:
        for key, value in delta.items():
            total[key] = total.get(key, 0) + value
    return total


def tier_failure(exc: BaseException, fs: fsspec.AbstractFileSystem,
                 delta: dict[str, float] | None) -> StorageError | None:
    """The StorageError to record when `exc` ended a run because the tier kept failing, else None.

    A read that gave up raises StorageError where it happens; a loader that reads in worker processes
    reports it as the sample's read error, so the tier's shared `failed_reads` counter decides."""
    if isinstance(exc, StorageError):
        return exc
    fs = tier_of(fs)
    if not delta or not delta.get("failed_reads"):
        return None
    spec = getattr(fs, "spec", None)
    name, attempts = (spec.name, spec.retry.max_attempts) if spec is not None else ("?", "several")
    first = redact((str(exc).splitlines() or [""])[0])
    culprit = first.split(": ", 1)[0]
    # The loaders' read errors start with the file's path; another error (one the failed reads led to) is said as
    # what ended the run, never passed off as a file.
    example = f"e.g. {culprit}" if "/" in culprit else f"the run ended on {type(exc).__name__}: {first}"
    return StorageError(f"storage tier {name!r} keeps failing: {int(delta['failed_reads'])} read(s) gave up after "
                        f"{attempts} attempts each ({int(delta.get('retries', 0))} retries in all), {example}")


# From this share of a tier's request time run past the tier's figures by the storage under it, the figures
# measured through the tier are that storage's, not the tier's (the emulation can only slow it down).
BASE_BOUND_SHARE = 0.2


def base_share(counters: dict[str, float] | None) -> float | None:
    """The share of the requests' time (arrival to end) that the storage under the tier took past the end the
    tier's figures gave them: 0 when the emulation set every request's time; None without requests or a tier."""
    if not counters or not counters.get("request_s"):
        return None
    return float(counters.get("base_over_s", 0.0)) / float(counters["request_s"])


def base_bound_text(tier: str, under: str, mb_s: float | None) -> str:
    """What a figure through tier `tier` says when the storage under it bounded it (`base_share` >= the bound)."""
    rate = f" at {mb_s:,.0f} MB/s" if mb_s is not None else ""
    return f"bounded by the {under}{rate}: not a figure of tier {redact(tier)}"


def storage_under(fs: fsspec.AbstractFileSystem, root: str = "") -> str:
    """The storage a tier's reads end on, as results name it: `local disk`, else the URL's scheme."""
    from loadopt.storage.emulated import EmulatedFileSystem

    fs = tier_of(fs)
    base = fs.base_fs if isinstance(fs, EmulatedFileSystem) else fs
    if is_local_fs(base):
        return "local disk"
    return redact(str(root).split("://", 1)[0] + "://") if "://" in str(root) else f"{base.protocol} storage"


def tier_label(tier: str | dict[str, Any] | TierSpec) -> str:
    """A short name for `storage.tier` (a profile's or inline spec's `name`), safe to print and store."""
    return redact(resolve_tier(tier).name)
