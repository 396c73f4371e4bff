"""The `kvikio` backend: raw shards read with cuFile straight into GPU memory."""
