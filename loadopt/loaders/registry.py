"""The registry of backends by name: the built-ins, listed once in `BUILTINS`, then the outside packages'
entry points in the `loadopt.loaders` group (docs/plugins.md), then the backends `register`ed in this
process. Modules are imported on first use; one that fails to import is listed as unavailable (a
stand-in whose `available()` gives the import error), never a crash of the listing.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import entry_points
from typing import Any, TypeVar

import numpy as np

from loadopt.config_models import Config
from loadopt.errors import ConfigError
from loadopt.loaders.base import HostBatch, Loader, NoSettings

ENTRY_POINT_GROUP = "loadopt.loaders"

# The one list of built-in backends. Kept here rather than as entry points in pyproject.toml: entry points
# exist only once the package is installed, and loadopt must list its own backends when imported from a
# checkout (PYTHONPATH, a vendored copy) too. Outside packages use the entry-point group.
BUILTINS: dict[str, str] = {"torch": "loadopt.loaders.torch_dl.loader:TorchLoader",
                            "arrow": "loadopt.loaders.arrow.loader:ArrowLoader",
                            "posix": "loadopt.loaders.posix.loader:PosixLoader",
                            "kvikio": "loadopt.loaders.kvikio.loader:KvikioLoader",
                            "dali": "loadopt.loaders.dali.loader:DaliLoader",
                            # other libraries' input paths, measured by the same harness (loaders/peer_*.py)
                            "webdataset": "loadopt.loaders.peers.webdataset:WebDatasetLoader",
                            "streaming": "loadopt.loaders.peers.streaming:StreamingLoader",
                            "litdata": "loadopt.loaders.peers.litdata:LitDataLoader",
                            "ffcv": "loadopt.loaders.peers.ffcv:FfcvLoader"}

LoaderT = TypeVar("LoaderT", bound=type[Loader[Any]])

_registered: dict[str, type[Loader[Any]]] = {}
_clashes_warned: set[tuple[str, str]] = set()


def register(name: str) -> Callable[[LoaderT], LoaderT]:
    """Class decorator registering a backend in this process (entry points do it across packages)."""

    def decorate(cls: LoaderT) -> LoaderT:
        cls.name = name
        _registered[name] = _buildable(name, cls)
        return cls

    return decorate


def unregister(name: str) -> None:
    """Forget the backend class this process holds for `name` (a `register`ed one, or an entry point's
    class already imported): the next `backend_class(name)` looks it up again."""
    _registered.pop(name, None)


def _targets() -> dict[str, str]:
    """name -> "module:attribute" of every backend: the built-ins, then the entry points of the group.

    A name taken twice keeps the first: a built-in over an entry point (an outside package cannot replace
    torch by accident), the package found first on sys.path over a later one; either clash is warned about once,
    naming both targets. An entry point naming a built-in's own target (loadopt's metadata from an older
    install) is no clash."""
    targets = dict(BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        kept = targets.setdefault(ep.name, ep.value)
        if kept != ep.value and (ep.name, ep.value) not in _clashes_warned:
            _clashes_warned.add((ep.name, ep.value))
            dist = getattr(getattr(ep, "dist", None), "name", None)
            whose = "the built-in" if ep.name in BUILTINS else "found first on sys.path"
            warnings.warn(f"backend {ep.name!r}: the entry point {ep.value}{f' (package {dist})' if dist else ''} "
                          f"is ignored: {ep.name!r} is already {kept} ({whose}); register it under another name",
                          UserWarning, stacklevel=2)
    return targets


def backend_names() -> list[str]:
    """Every backend known here, installed or not, built-ins first."""
    names = list(_targets())
    return names + [n for n in _registered if n not in names]


def backend_class(name: str) -> type[Loader[Any]]:
    """The backend registered as `name`. A backend whose module fails to import comes back as a
    class whose `available()` gives the import error, so listing backends never crashes."""
    if name in _registered:
        return _registered[name]
    target = _targets().get(name)
    if target is None:
        raise KeyError(f"unknown backend {name!r} (known: {', '.join(backend_names())})")
    module_name, _, attr = target.partition(":")
    cls: type[Loader[Any]]
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # an outside package may fail in any way; report, don't crash
        reason = f"cannot import {target}: {type(exc).__name__}: {exc}"
        cls = type(f"Broken_{name}", (_BrokenLoader,), {"_reason": reason})
    cls = _buildable(name, cls)
    cls.name = name
    _registered[name] = cls
    return cls


def configured_loader(name: str, config: Config, dataset: Any, settings: Any, **placement: Any) -> Loader[Any]:
    """Backend `name` over `dataset` as `config` runs it (its pipeline, seed and `dataset.on_error`), not yet
    prepared: every path that converts or reads for a config builds its loaders here, so none can miss the
    dataset's policy. `placement`: device, rank, world_size, epoch."""
    return backend_class(name)(dataset, config.pipeline, settings, seed=config.seed,
                               on_error=config.dataset.on_error, **placement)


def backend_for(name: str, where: str) -> type[Loader[Any]]:
    """`backend_class(name)`, an unknown name being a user error that names `where` it was asked for."""
    try:
        return backend_class(name)
    except KeyError as exc:
        raise ConfigError(f"{where}: {exc.args[0]}") from None


def _buildable(name: str, cls: type[Loader[Any]]) -> type[Loader[Any]]:
    """`cls`, or an unavailable stand-in saying which of the contract's methods it does not implement (a
    backend written against an older contract would otherwise be a `TypeError` when first built)."""
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if not missing:
        return cls
    renamed = "produce" in missing and any("_produce" in vars(k) for k in cls.__mro__)
    hint = "; it defines `_produce`, the previous contract's name: rename it `produce`" if renamed else ""
    reason = (f"{cls.__module__}.{cls.__qualname__} does not implement {', '.join(f'`{m}`' for m in missing)}, "
              f"which every backend must (docs/plugins.md{hint})")
    # Its own Settings kept: a config setting its knobs is then told why the backend cannot run, not that
    # the knobs are unknown.
    return type(f"Broken_{name}", (_BrokenLoader,), {"_reason": reason, "Settings": cls.Settings})


class _BrokenLoader(Loader[NoSettings]):
    """The stand-in for a backend whose module fails to import: unavailable, with the import error."""

    _reason = ""

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return False, cls._reason

    def produce(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:  # pragma: no cover - never built
        raise RuntimeError(self._reason)
