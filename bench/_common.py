"""Shared by the benchmark scripts: the RESULT line, building loaders from a config, timing rounds."""

from __future__ import annotations

import operator
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def result_line(name: str, ratio: float, op: str, target: float) -> str:
    """`RESULT <name> ratio=<r> target<op><v> pass|FAIL`, the form DESIGN.md fixes."""
    verdict = "pass" if OPS[op](ratio, target) else "FAIL"
    return f"RESULT {name} ratio={ratio:.3g} target{op}{target:g} {verdict}"


def build_loader(config, backend: str, **settings):
    """A loader of `backend` for the config's train split, settings given as keywords."""
    from loadopt.config import expand_settings
    from loadopt.device import resolve_device
    from loadopt.loaders.base import backend_class
    from loadopt.storage.imagefolder import open_dataset

    cls = backend_class(backend)
    dataset = open_dataset(config)
    point = expand_settings(cls.Settings, settings, f"loaders.{backend}", "bench")[0]
    return cls(dataset, config.pipeline, point, device=resolve_device(config.workload.device), seed=config.seed)
