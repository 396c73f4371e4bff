"""The `dali` backend: NVIDIA DALI's native pipeline decodes, crops and normalises."""
