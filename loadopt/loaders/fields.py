"""A sample's fields besides its image and label (a caption, a JSON target, a dict item's other keys): which ones a
loader's batches carry, and how a batch's values are collated for training code."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from loadopt.config_models import PipelineConfig
from loadopt.errors import ConfigError
from loadopt.storage.dataset import Dataset, SampleFields

# What iterating a loader yields: (inputs, labels), and the fields of `Loader.field_names` where there are any.
Batch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[str, Any]]


def fields_to_carry(dataset: Dataset, pipeline: PipelineConfig) -> list[str]:
    """The fields each batch carries: `pipeline.fields`, each one the dataset's samples have (else one line
    naming it); null: every field the dataset has."""
    has = dataset.field_names() if isinstance(dataset, SampleFields) else []
    if pipeline.fields is None:
        return has
    # a field only some samples have may be named: the others fail (`missing_fields`)
    some = dataset.field_names(partial=True) if isinstance(dataset, SampleFields) else []
    unknown = [name for name in pipeline.fields if name not in some]
    if unknown:
        raise ConfigError(f"pipeline.fields: {dataset.root} has no field {unknown[0]!r} (its fields: "
                          f"{', '.join(has) or 'none besides the image and label'})")
    return list(pipeline.fields)


def collate_fields(fields: dict[str, list]) -> dict[str, Any]:
    """A batch's fields as training code takes them: numbers (and equal-length lists of them) as a tensor, anything
    else (strings, JSON objects, lists of boxes of varying length) as a list in the batch's order."""
    out: dict[str, Any] = {}
    for name, values in fields.items():
        try:
            tensor = torch.as_tensor(values) if values and all(_numeric(v) for v in values) else None
        except (TypeError, ValueError, RuntimeError):  # ragged lists
            tensor = None
        out[name] = tensor if tensor is not None else list(values)
    return out


def _numeric(value: Any) -> bool:
    if isinstance(value, bool | int | float | np.number):
        return True
    return isinstance(value, list | tuple | np.ndarray) and all(_numeric(v) for v in value)
