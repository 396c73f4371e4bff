"""DLIO workload files as loadopt configs (`loadopt import-dlio WORKLOAD.yaml > config.yaml`).

DLIO (argonne-lcf/dlio_benchmark) describes a training job's I/O as a workload YAML: the dataset
(`num_files_train`, `num_samples_per_file`, `record_length_bytes` and its spread, the file format),
the reader (`batch_size`, `read_threads`) and the emulated computation per batch. Each maps onto a
`dataset.kind: records` config (storage/records.py). Whatever has no equivalent here is named in the
output's header, key by key, never dropped silently.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from loadopt.errors import ConfigError

# DLIO spells several keys two ways over its versions (record_length / record_length_bytes, ..._std / ..._stdev).
_RECORD_KEYS = {
    "record_bytes": ("record_length_bytes", "record_length"),
    "record_bytes_stdev": ("record_length_bytes_stdev", "record_length_stdev", "record_length_std"),
    "delivered_bytes": ("record_length_bytes_resize", "record_length_resize"),
}
_READERS = ("pytorch", "tensorflow", "dali", "native_dali")
# Keys read (the rest are named as having no equivalent).
_MAPPED = {
    "model", "model.name", "dataset.num_files_train", "dataset.num_samples_per_file", "dataset.format",
    "reader.batch_size", "reader.read_threads", "reader.data_loader", "reader.file_shuffle", "reader.sample_shuffle",
    "train.computation_time", "dataset.data_folder", "reader.prefetch_size",
    *(f"dataset.{key}" for keys in _RECORD_KEYS.values() for key in keys),
}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _first(flat: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((flat[f"dataset.{key}"] for key in keys if f"dataset.{key}" in flat), None)


def _number(value: Any, key: str, source: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key}: expected a number, got {value!r}") from None


def _records_spec(flat: dict[str, Any], source: str, notes: list[str]) -> dict[str, Any]:
    """The config's `dataset.records` of a DLIO workload's `dataset` keys (`notes` takes what did not map)."""
    fmt = str(flat.get("dataset.format", "npz"))
    if fmt not in ("npz", "raw"):
        notes.append(f"dataset.format {fmt}: no {fmt} reader here; raw records of the same sizes instead (no "
                     "per-record framing)")
    record = _first(flat, _RECORD_KEYS["record_bytes"])
    if record is None:
        raise ConfigError(f"{source}: dataset.record_length_bytes: missing (the size of a sample)")
    records: dict[str, Any] = {
        "record_bytes": round(_number(record, "dataset.record_length_bytes", source)),
        "record_bytes_stdev": round(_number(_first(flat, _RECORD_KEYS["record_bytes_stdev"]) or 0,
                                            "dataset.record_length_bytes_stdev", source)),
        "samples_per_file": int(_number(flat.get("dataset.num_samples_per_file", 1), "num_samples_per_file", source)),
        "num_files": int(_number(flat.get("dataset.num_files_train", 1), "num_files_train", source)),
        "file_format": fmt if fmt in ("npz", "raw") else "raw",
    }
    resize = _first(flat, _RECORD_KEYS["delivered_bytes"])
    records["delivered_bytes"] = round(_number(resize, "dataset.record_length_bytes_resize", source)) \
        if resize is not None else min(records["record_bytes"], 2 * 1024 * 1024)
    if resize is None:
        notes.append(f"dataset.record_length_bytes_resize: not set; each record's first "
                     f"{records['delivered_bytes']:,} bytes are delivered")
    return records


def config_from_dlio(workload: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """The loadopt config of a DLIO workload mapping, and one line per DLIO setting without an equivalent."""
    if not isinstance(workload, dict) or not isinstance(workload.get("dataset"), dict):
        raise ConfigError(f"{source}: not a DLIO workload file (no `dataset:` mapping)")
    flat = _flatten(workload)
    notes: list[str] = []
    model = workload.get("model")
    name = str(model.get("name") if isinstance(model, dict) else model or Path(source).stem)
    records = _records_spec(flat, source, notes)
    batch = int(_number(flat.get("reader.batch_size", 1), "reader.batch_size", source))
    reader = str(flat.get("reader.data_loader", "pytorch"))
    if reader not in _READERS:
        notes.append(f"reader.data_loader {reader}: measured with loadopt's torch DataLoader backend instead")
    elif reader != "pytorch":
        notes.append(f"reader.data_loader {reader}: measured with loadopt's torch DataLoader backend (the same "
                     "reads by read_threads workers)")
    # DLIO's pytorch reader keeps its workers across epochs and prefetches ceil(prefetch_size / read_threads)
    # batches a worker, 2 when prefetch_size is 0 (dlio_benchmark 2.0.0, data_loader/torch_data_loader.py);
    # prefetch_size is 2 where the workload does not set it (utils/config.py): 1 a worker from 2 threads up.
    threads = int(_number(flat.get("reader.read_threads", 1), "reader.read_threads", source))
    prefetch_size = int(_number(flat.get("reader.prefetch_size", 2), "reader.prefetch_size", source))
    torch_settings: dict[str, Any] = {"num_workers": threads, "variant": "plain"}
    if threads > 0:
        torch_settings.update(persistent_workers=True,
                              prefetch_factor=max(1, math.ceil(prefetch_size / threads)) if prefetch_size else 2)
    shuffled = all(str(flat.get(key, "seed")).lower() not in ("off", "false", "none")
                   for key in ("reader.file_shuffle", "reader.sample_shuffle"))
    config: dict[str, Any] = {
        "name": name,
        "dataset": {"kind": "records", "path": None, "records": records},
        "pipeline": {"batch_size": batch, "shuffle": shuffled},
        "workload": {"step_time_ms": round(_number(flat.get("train.computation_time", 0), "train.computation_time",
                                                   source) * 1000, 3)},
        "loaders": {"torch": torch_settings},
    }
    if "dataset.data_folder" in flat:
        notes.append(f"dataset.data_folder {flat['dataset.data_folder']}: loadopt generates its own records "
                     "(dataset.path: null); set dataset.path to a folder of *.npz (an `x` array, one record a row) "
                     "or *.bin files to read those")
    if "metric.au" in flat:
        notes.append(f"metric.au {flat['metric.au']}: pass it as `loadopt tiers --au {flat['metric.au']}`")
    for key in sorted(flat):
        if key not in _MAPPED and key != "metric.au":
            notes.append(f"{key} {flat[key]}: no equivalent in loadopt")
    return config, notes


def import_dlio(path: str | Path) -> str:
    """The YAML text of the loadopt config for the DLIO workload file at `path`, headed by what did not map."""
    from loadopt.config import config_from_dict
    from loadopt.files import read_yaml

    path = Path(path)
    config, notes = config_from_dlio(read_yaml(path, "DLIO workload file"), str(path))

    config_from_dict(config, str(path))  # what is written must load: a bad value fails here, named
    header = [f"# loadopt config imported from the DLIO workload {path.name} (loadopt import-dlio)"]
    header += ["# no equivalent, or read differently:"] + [f"#   {note}" for note in notes] if notes else []
    return "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False)
