"""The `loadopt bench` harness: plays the job against each loader setting, measures, tunes, ranks and decides."""
