"""Datasets and their stored forms: sources opened by kind, conversions, storage tiers and remote storage."""
