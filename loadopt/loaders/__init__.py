"""Loader backends: the protocol and registry (`base`) and one module per backend."""

from loadopt.loaders.base import HostBatch, Loader, backend_class, backend_names, register

__all__ = ["HostBatch", "Loader", "backend_class", "backend_names", "register"]
