"""`loadopt tiers`: how many accelerators each storage tier keeps busy, measured and predicted, and at what cost."""
