"""The `posix` backend: raw shards read with `preadv` (optionally O_DIRECT) into aligned staging."""
