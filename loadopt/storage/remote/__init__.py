"""Datasets and conversions on remote storage: opening URLs with retries, the saved listing, the local shard cache."""
