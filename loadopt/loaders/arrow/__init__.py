"""The `arrow` backend: samples stored once in memory-mapped Arrow IPC files."""
