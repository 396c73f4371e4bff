"""loadopt: measure and pick the fastest input path for a deep-learning job.

    from loadopt import make_loader
    loader = make_loader("configs/imagenet.yaml")      # backend="auto": the last bench's winner
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader: ...

The names below are imported on first use, so `import loadopt.cli` (and `loadopt --help`) stays light:
torch and the loaders load only when a command needs them.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from loadopt.errors import LoadoptError
from loadopt.version import __version__

# name -> the module that defines it
_LAZY = {"make_loader": "loadopt.api", "make_preprocessor": "loadopt.api", "Config": "loadopt.config_models",
         "load_config": "loadopt.config",
         "measure": "loadopt.measure", "measure_steps": "loadopt.measure", "run_bench": "loadopt.bench.runner"}

if TYPE_CHECKING:
    from loadopt.api import make_loader, make_preprocessor
    from loadopt.bench.runner import run_bench
    from loadopt.config import load_config
    from loadopt.config_models import Config
    from loadopt.measure import measure, measure_steps


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loadopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


class _Package(types.ModuleType):
    """`loadopt.measure` is the function, also once the `loadopt.measure` package is imported (the import
    system then sets the package as this module's attribute: the function it exports is kept instead)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "measure" and isinstance(value, types.ModuleType) and hasattr(value, "measure"):
            value = value.measure
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["Config", "LoadoptError", "load_config", "make_loader", "make_preprocessor", "measure", "measure_steps",
           "run_bench", "__version__"]
