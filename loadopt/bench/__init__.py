"""The measuring harness, its metrics, the emulated accelerator and results files."""
