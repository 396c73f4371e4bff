"""Storage tiers: the spec a config names, the emulating filesystem that imposes its limits, the probe."""
