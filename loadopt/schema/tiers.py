"""A row of `loadopt tiers` (tiers.json, or a bench results file's `tiers` section), versions 1 and 2."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class _Row(BaseModel):
    model_config = ConfigDict(extra="allow")


class TierCost(_Row):
    per_month: float | None = None  # the capacity stored, at the tier's price


class TierRow(_Row):
    """One storage tier of `loadopt tiers` (or a bench results file's `tiers` section)."""

    name: str
    au_threshold: float | None = None
    accelerators_supported: int | None = None  # measured
    predicted_accelerators: int | None = None
    measured_note: str = ""
    delivered_mb_s: float | None = None
    samples_per_s: float | None = None
    accelerator_utilisation: float | None = None
    cpu_load: float | None = None
    price_per_tb_month: float | None = None
    cost_per_supported_accelerator: float | None = None  # $ a month per accelerator kept at the threshold
    cost: TierCost = TierCost()
    bounded_by_base: str | None = None  # an emulated tier over slower storage: what its figures are instead

    @model_validator(mode="before")
    @classmethod
    def _one_key_each(cls, data: Any) -> Any:
        """Version 1 rows: the same value under two keys; keep the one key of version 2."""
        if not isinstance(data, dict):
            return data
        row = dict(data)
        for old, new in (("tier", "name"), ("measured", "accelerators_supported"),
                         ("predicted", "predicted_accelerators")):
            if old in row:
                value = row.pop(old)
                row.setdefault(new, value)
        if isinstance(row.get("cost"), dict) and "per_accelerator_month" in row["cost"]:
            cost = dict(row["cost"])
            row.setdefault("cost_per_supported_accelerator", cost.pop("per_accelerator_month"))
            row["cost"] = cost
        return row
