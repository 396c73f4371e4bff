"""Loader backends: the contract, the registry by name, one package per backend, and what a plugin author
builds a backend from (docs/plugins.md): `Loader` (or `RingLoader` and its
`RingSettings` for a producer thread filling a batch ring), `HostBatch`, `WorkKind`, `register`, and the
shared crop plan in `loadopt.loaders.transforms` (source JPEGs) and `loadopt.loaders.crops` (stored pixels)."""

from loadopt.loaders.base import HostBatch, Loader, LoaderCounters, NoSettings, WorkKind
from loadopt.loaders.registry import BUILTINS, ENTRY_POINT_GROUP, backend_class, backend_names, register


def __getattr__(name: str):
    # The ring imports the storage and transform modules: loaded when a plugin asks for it, not by the registry.
    if name in ("RingLoader", "RingSettings"):
        from loadopt.loaders import ring

        return getattr(ring, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BUILTINS", "ENTRY_POINT_GROUP", "HostBatch", "Loader", "LoaderCounters", "NoSettings", "RingLoader",
           "RingSettings", "WorkKind", "backend_class", "backend_names", "register"]
