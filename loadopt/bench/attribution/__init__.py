"""Which stage bounds a setting: the machine's ceilings, stages run apart, and the one-sentence verdict."""
