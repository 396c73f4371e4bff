"""loadopt: measure and pick the fastest input path for a deep-learning job.

    from loadopt import make_loader
    loader = make_loader("configs/imagenet.yaml")      # backend="auto": the last bench's winner
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader: ...
"""

from loadopt.api import make_loader
from loadopt.config import Config, load_config
from loadopt.errors import LoadoptError
from loadopt.measure import measure, measure_steps

__version__ = "0.1.0"


def run_bench(*args, **kwargs):
    """See `loadopt.bench.runner.run_bench` (imported lazily: it pulls in the harness)."""
    from loadopt.bench.runner import run_bench as _run_bench

    return _run_bench(*args, **kwargs)


__all__ = ["Config", "LoadoptError", "load_config", "make_loader", "measure", "measure_steps", "run_bench",
           "__version__"]
