"""Storage tiers: where a dataset is read from and what limits it is read under.

A tier is `local` (the dataset's own location, read as it is), a named profile from
`loadopt/storage/tiers/tiers.yaml`, linked as `configs/tiers.yaml` (figures of a typical device or network
store, emulated), or an inline spec in `storage.tier`. `base` points a tier at real storage (any
fsspec URL: a path, `http(s)://`, `s3://`, `memory://`); the emulated limits (bandwidth, latency,
concurrency, faults) are imposed on whatever is read through it by a wrapper filesystem
(`EmulatedFileSystem`), shared by every process that reads through the same tier instance.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from loadopt.errors import ConfigError
from loadopt.files import read_yaml
from loadopt.schema.documents import ConfigDump
from loadopt.storage.remote.access import RetryPolicy, redact

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


def tier_label(tier: str | dict[str, Any] | TierSpec) -> str:
    """A short name for `storage.tier` (a profile's or inline spec's `name`), safe to print and store."""
    return redact(resolve_tier(tier).name)
