"""The tuner's search space: each backend's knobs narrowed by the config (a list under
`loaders.<backend>` replaces that knob's values, a one-element list pins it; a scalar is where the
search starts and is added to the values), the start (the backend's default for this machine when a
list holds it, else the list's first value: also what `make_loader` takes without a bench decision),
the order in which a knob's values are tried, and what the machine allows a setting to use."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import psutil
from pydantic import BaseModel

from loadopt.config import backend_settings, expand_settings
from loadopt.config_models import Config
from loadopt.loaders.base import Loader
from loadopt.machine import usable_cores
from loadopt.schema.documents import Knobs


@dataclass(frozen=True)
class MachineLimits:
    """What a setting may use: cores for its threads and processes, bytes of shared and pinnable memory."""

    cores: int
    shared_bytes: int
    pinned_bytes: int

    @classmethod
    def here(cls) -> MachineLimits:
        try:
            stat = os.statvfs("/dev/shm")
            shm = stat.f_bavail * stat.f_frsize
        except OSError:
            shm = 0
        available = psutil.virtual_memory().available
        # Leave room for everything else: most of /dev/shm, half of the available RAM for page-locking.
        return cls(usable_cores(), int(0.8 * shm), int(0.5 * available))

    def refuses(self, cls: type[Loader], settings: BaseModel, pipeline) -> str:
        """Why this setting is over the machine ("" when it fits)."""
        demand = cls.cpu_demand(settings)
        if demand > self.cores:
            return f"needs {demand} cores, {self.cores} usable"
        need = cls.memory_demand(settings, pipeline)
        if need.get("shared", 0) > self.shared_bytes:
            return f"needs {need['shared'] / 2**20:,.0f} MiB of shared memory, {self.shared_bytes / 2**20:,.0f} free"
        if need.get("pinned", 0) > self.pinned_bytes:
            return f"pins {need['pinned'] / 2**20:,.0f} MiB, {self.pinned_bytes / 2**20:,.0f} MiB may be pinned"
        return ""


def start_settings(cls: type[Loader], raw: Knobs, where: str, source: str
                   ) -> tuple[BaseModel, dict[str, str]]:
    """The setting a backend starts from, given its raw config settings (lists sweep a knob), and why each
    knob has its value. A swept knob takes the backend's own default for this machine when the sweep holds
    it (the backend's sensible choice: e.g. torch's tuned variant, one worker per core up to 8), else the
    sweep's first value; `where` and `source` name the settings in errors (`loaders.torch`, the file)."""
    points = expand_settings(cls.Settings, raw, where, source)  # validates every point
    start, defaults = points[0], cls.Settings()
    why: dict[str, str] = {}
    for key, field in cls.Settings.model_fields.items():
        default = getattr(defaults, key)
        sized = " for this machine" if field.default_factory is not None else ""
        if isinstance(raw.get(key), list):
            values = list(dict.fromkeys(getattr(p, key) for p in points))
            if default in values:
                start = cls.Settings(**{**start.model_dump(), key: default})
                why[key] = f"swept {values} in {where}: the backend's default{sized}"
            else:
                why[key] = f"swept {values} in {where}: its first value (the backend's default{sized}, {default!r}, " \
                           "is not among them)"
        elif key in raw:
            why[key] = f"set in {where}"
        else:
            why[key] = f"the backend's default{sized}"
    return start, why


def search_space(config: Config, name: str, cls: type[Loader], cores: int) -> tuple[dict[str, list[Any]], BaseModel]:
    """The knobs to search (the backend's space narrowed by the config's lists) and the start point."""
    raw = dict(config.loaders.get(name) or {})
    points = backend_settings(config, name)  # validates, naming the file and key
    start = start_settings(cls, raw, f"loaders.{name}", config.source)[0]
    space = {k: list(v) for k, v in cls.knob_space(cores).items() if k in cls.Settings.model_fields}
    for key, value in raw.items():
        if isinstance(value, list):
            space[key] = list(dict.fromkeys(getattr(p, key) for p in points))  # validated values, in order
        elif key in space and getattr(start, key) not in space[key]:
            space[key].append(getattr(start, key))  # the configured value is a candidate too
            if numeric(space[key]):
                space[key].sort()  # keep "least to most resources"
    return space, start


def numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def directions(values: list[Any], current: Any) -> list[list[Any]]:
    """The values of a knob to try from `current`: for an ordered numeric knob, outwards in each
    direction (nearest first, so a climb stops at the first value that does not help); otherwise all."""
    if not numeric(values) or current not in values:
        return [list(values)]
    at = values.index(current)
    return [values[at - 1 :: -1] if at > 0 else [], values[at + 1 :]]
