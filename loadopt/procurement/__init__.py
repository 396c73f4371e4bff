"""`loadopt tiers`: how many accelerators each storage tier keeps busy, measured and predicted, and at what cost; and
DLIO workload files (MLPerf Storage's benchmark) as loadopt configs."""
