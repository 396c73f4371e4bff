"""The validated config: YAML loading, `--set` overrides and one-line errors (the pydantic models are
`loadopt.config_models`'s, re-exported here).

This module sits above storage and loaders: it checks each backend's settings against the model the
backend declares (the registry) and the tier against the known tiers. Storage, loaders and the device
import only `loadopt.config_models` and `loadopt.files`, never this module.

Every validation problem becomes `ConfigError("<file>: <key.path>: <what is wrong>")`, so a user sees
which file and which key to fix. Backend settings under `loaders:` are validated by the model that
each backend declares (`Loader.Settings`); a list value there is a sweep over that knob.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from loadopt.config_models import (  # noqa: F401 - re-exported: the models are this module's interface
    Config,
    DatasetConfig,
    PipelineConfig,
    RecordSpec,
    ReportConfig,
    StorageConfig,
    SyntheticSpec,
    TokenSpec,
    WorkloadConfig,
)
from loadopt.errors import ConfigError
from loadopt.files import yaml_problem
from loadopt.loaders.registry import backend_class
from loadopt.schema.documents import Knobs
from loadopt.storage.tiers.spec import resolve_tier

# ---------------------------------------------------------------------------------------------
# Error messages


def _key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _describe(error: ErrorDetails) -> str:
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind in ("float_parsing", "float_type"):
        return f"expected a number, got {value!r}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"expected an integer, got {value!r}"
    if kind in ("bool_parsing", "bool_type"):
        return f"expected true or false, got {value!r}"
    if kind == "string_type":
        return f"expected a string, got {value!r}"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected')}, got {value!r}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping of keys, got {value!r}"
    message = error["msg"]
    message = message[0].lower() + message[1:]
    return f"{message}, got {value!r}"


def _raise_validation(exc: ValidationError, source: str, prefix: tuple[Any, ...] = (), overrides=()) -> None:
    lines = []
    for error in exc.errors():
        loc = prefix + tuple(error["loc"])
        path = _key_path(loc)
        lines.append(f"{_source_for(path, source, overrides)}: {path}: {_describe(error)}")
    raise ConfigError("\n".join(lines)) from None


def _source_for(path: str, source: str, overrides) -> str:
    for expr in overrides:
        key = expr.split("=", 1)[0]
        if path == key or path.startswith(key + ".") or path.startswith(key + "["):
            return f"{source} (--set {expr})"
    return source


# ---------------------------------------------------------------------------------------------
# Loading


def apply_override(raw: dict[str, Any], expr: str, source: str = "--set") -> None:
    """Apply one `dotted.key=value` override in place; the value is parsed as YAML (`40`, `[1,2]`)."""
    if "=" not in expr:
        raise ConfigError(f"--set {expr}: expected KEY=VALUE, e.g. workload.step_time_ms=40")
    key, text = expr.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {expr}: empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{source} (--set {expr}): {part}: is not a mapping, cannot set a key inside it")
        node = child
    node[parts[-1]] = value


def config_from_dict(raw: Any, source: str = "<dict>", overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Validate a raw mapping (e.g. parsed YAML) plus `--set` overrides into a `Config`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(raw).__name__}")
    raw = _deep_copy(raw)
    for expr in overrides:
        apply_override(raw, expr, source)
    try:
        config = Config(**raw, source=source)
    except ValidationError as exc:
        _raise_validation(exc, source, overrides=overrides)
    except TypeError as exc:  # a non-string top-level key
        raise ConfigError(f"{source}: {exc}") from None
    for name in config.loaders:
        backend_settings(config, name, overrides=overrides)  # validates every sweep point
    resolve_tier(config.storage.tier, where=f"{_source_for('storage.tier', source, overrides)}: storage.tier")
    _check_one_step_source(raw, config, source, overrides)
    return config


def _check_one_step_source(raw: dict[str, Any], config: Config, source: str, overrides) -> None:
    """What the workload says of its step must hold together: a real model step needs images, and
    workload.accelerator and a step_time_ms of its own are two answers to one question (refuse both)."""
    given = (raw.get("workload") or {}).get("step_time_ms")
    workload = config.workload
    if workload.model != "none" and config.dataset.kind != "images":
        where = _source_for("workload.model", source, overrides)
        raise ConfigError(f"{where}: workload.model: {workload.model} is an image model; use none (the emulated "
                          f"accelerator) for {config.dataset.kind}")
    if workload.accelerator is not None and workload.model != "none":
        where = _source_for("workload.model", source, overrides)
        raise ConfigError(f"{where}: workload.model: {workload.model} runs a real step, workload.accelerator "
                          f"({workload.accelerator}) emulates one; set one of them")
    if workload.accelerator is None or given is None:
        return
    default = WorkloadConfig.model_fields["step_time_ms"].default
    if not any(math.isclose(float(given), v) for v in (default, workload.step_time_ms)):
        where = _source_for("workload.step_time_ms", source, overrides)
        raise ConfigError(f"{where}: workload.step_time_ms: set it or workload.accelerator ({workload.accelerator}: "
                          f"{workload.step_time_ms:g} ms per batch of {config.pipeline.batch_size}), not both")


# The configs shipped inside the package (`configs/` in a checkout links here): `loadopt bench imagenet` from anywhere.
BUNDLED_CONFIGS = Path(__file__).resolve().parent / "configs"
NOT_BUNDLED = ("tiers",)  # the tier profiles, not a bench config


def bundled_configs() -> list[str]:
    """The names of the bundled configs (`imagenet`, `serve`, ...)."""
    return sorted(p.stem for p in BUNDLED_CONFIGS.glob("*.yaml") if p.stem not in NOT_BUNDLED)


def bundled_config(name: str) -> Path | None:
    """The bundled config named `name` (`imagenet` or `imagenet.yaml`), or None."""
    stem = name.removesuffix(".yaml").removesuffix(".yml")
    return BUNDLED_CONFIGS / f"{stem}.yaml" if "/" not in name and stem in bundled_configs() else None


def config_path(path: str | os.PathLike[str]) -> Path:
    """The config file `path` names: the file itself where there is one, else the bundled config of that name."""
    given = Path(path)
    if given.exists():
        return given
    bundled = bundled_config(str(path))
    if bundled is not None:
        return bundled
    if os.sep in str(path):  # a path, not a name: the file is what is missing
        raise ConfigError(f"{path}: config file not found")
    raise ConfigError(f"{path}: config file not found, nor a bundled config of that name (bundled: "
                      f"{', '.join(bundled_configs())}; `loadopt init NAME` writes one here to edit)")


def load_config(path: str | os.PathLike[str] | Config, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read and validate a YAML config file, or the bundled config of that name (`imagenet`); errors name the file
    and the key."""
    if isinstance(path, Config):
        if not overrides:
            return path
        # a step time derived from workload.accelerator is derived again (the batch size may change)
        derived = {"workload": {"step_time_ms"}} if path.workload.accelerator else None
        return config_from_dict(path.model_dump(exclude=derived), path.source, overrides)
    source = str(path)
    try:
        text = config_path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a folder, expected a YAML config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read config file ({exc})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: {yaml_problem(exc)}") from None
    if raw is None:  # empty, or comments only: running every default instead would answer another question
        raise ConfigError(f"{source}: the config file is empty (expected YAML keys such as dataset, pipeline, "
                          "loaders; see configs/imagenet.yaml)")
    return config_from_dict(raw, source, overrides)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------
# Backend settings and sweeps


def expand_settings(model: type[BaseModel], raw: Knobs, where: str, source: str,
                    overrides: list[str] | tuple[str, ...] = ()) -> list[BaseModel]:
    """Validate a backend's raw settings; a list value sweeps that knob (the cartesian product).

    `where` is the key path of the settings (`loaders.torch`) for error messages.
    """
    choices: dict[str, list[Any]] = {}
    for key, value in raw.items():
        path = f"{where}.{key}"
        field = model.model_fields.get(key)
        if field is None:
            known = ", ".join(model.model_fields)
            raise ConfigError(f"{_source_for(path, source, overrides)}: {path}: unknown key (known: {known})")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ConfigError(f"{_source_for(path, source, overrides)}: {path}: empty list, nothing to sweep")
        adapter: TypeAdapter[Any] = TypeAdapter(field.rebuild_annotation())  # the type with its constraints
        checked = []
        for index, item in enumerate(values):
            try:
                checked.append(adapter.validate_python(item))
            except ValidationError as exc:
                loc = (*where.split("."), key, index) if isinstance(value, list) else (*where.split("."), key)
                _raise_validation(exc, source, prefix=loc, overrides=overrides)
        choices[key] = checked
    keys = list(choices)
    points = []
    for combo in itertools.product(*(choices[k] for k in keys)):
        try:
            points.append(model(**dict(zip(keys, combo, strict=True))))
        except ValidationError as exc:
            _raise_validation(exc, source, prefix=tuple(where.split(".")), overrides=overrides)
    return points


def backend_settings(config: Config, name: str, overrides: list[str] | tuple[str, ...] = ()) -> list[BaseModel]:
    """The validated sweep points of backend `name` as configured (one point when nothing is a list)."""
    try:
        cls = backend_class(name)
    except KeyError as exc:
        path = f"loaders.{name}"
        raise ConfigError(f"{_source_for(path, config.source, overrides)}: {path}: {exc.args[0]}") from None
    return expand_settings(cls.Settings, config.loaders.get(name) or {}, f"loaders.{name}", config.source,
                           overrides)
