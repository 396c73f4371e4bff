"""Objects a config names as `package.module:attribute` (a dataset factory, a per-sample transform): imported when
first needed, from the working directory as well as the installed packages, each failure one line naming the key."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from loadopt.errors import ConfigError


def import_named(spec: str, key: str) -> Any:
    """The object `spec` ("package.module:attribute", the attribute dotted for a class's member) names; a
    `ConfigError` naming `key` when it is not of that shape, its module does not import or lacks it."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{key}: {spec!r} is not of the form 'package.module:function'")
    # A console script's sys.path starts at its own folder: a user's module beside their config is found as
    # `python -m` would find it (as uvicorn and gunicorn do).
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a user's module may fail any way on import
        raise ConfigError(f"{key}: {spec!r}: cannot import {module_name} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'no message'})") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"{key}: {spec!r}: {module_name} has no {attribute!r}")
        found = getattr(found, part)
    return found


def name_of(function: Any) -> str:
    """`package.module:qualified.name` of a function or callable object, as a config would name it (a callable
    instance is named by its class: its settings are its own)."""
    named = function if hasattr(function, "__qualname__") else type(function)
    return f"{getattr(named, '__module__', '?')}:{getattr(named, '__qualname__', type(function).__name__)}"
