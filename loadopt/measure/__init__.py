"""Measuring an existing training loop where it runs: `loadopt.measure(loader)`, `loadopt.measure_steps()`,
and the zero-code form `loadopt measure train.py ARGS` (also `python -m loadopt.measure train.py ARGS`).

`loadopt.measure` is the function (the `loadopt` package binds it after importing this package), so
`loadopt.measure(loader)` works whichever was imported first; this package is `sys.modules["loadopt.measure"]`.
"""

from loadopt.measure.batch_structure import count_samples
from loadopt.measure.measuring import Measurement, measure, measure_steps
from loadopt.measure.script import ScriptError, run_script

__all__ = ["Measurement", "ScriptError", "count_samples", "measure", "measure_steps", "run_script"]
