"""A tar sample's fields: its small members besides the image and label (a `txt` caption, a `json` target), kept
in the shards' index as arrays and turned into the values a batch carries."""

from __future__ import annotations

import json

import numpy as np

# A sample's other members up to this size are its fields (a `txt` caption, a `json` target), read while indexing
# and kept in the index: a batch's fields cost no read. Larger ones (a depth map, a clip) are not fields.
FIELD_MAX_BYTES = 64 << 10
FIELDS_RULE = "fields<=64KiB"  # in the index's identity: an index made before fields were kept is made again


def field_arrays(fields: list[dict[str, bytes]]) -> dict[str, np.ndarray]:
    """Each field's members as index arrays: `field-<ext>-data` (their bytes end to end), `field-<ext>-ends` (where
    each sample's ends) and `field-<ext>-has` (whether the sample has one)."""
    out = {}
    for extension in sorted({name for sample in fields for name in sample}):
        values = [sample.get(extension) for sample in fields]
        out[f"field-{extension}-data"] = np.frombuffer(b"".join(v or b"" for v in values), np.uint8).copy()
        out[f"field-{extension}-ends"] = np.cumsum([len(v or b"") for v in values], dtype=np.int64)
        out[f"field-{extension}-has"] = np.array([v is not None for v in values], dtype=bool)
    return out


def field_value(extension: str, data: bytes) -> object:
    """A field member's value as training code takes it: text for `txt` (and other text), parsed `json`, the number
    of a `cls`/`id`/`index`, else the bytes."""
    if extension.endswith("json"):
        return json.loads(data)
    if extension.endswith(("cls", "cls2", "id", "index")):
        text = data.strip().decode("utf-8", "replace")
        return int(text) if text.lstrip("-").isdigit() else text
    if extension.endswith(("txt", "text", "caption")):
        return data.decode("utf-8", "replace")
    return data
