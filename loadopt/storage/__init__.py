"""Datasets: where samples live (local or fsspec), synthetic generation, page-cache control."""
