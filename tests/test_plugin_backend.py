"""The outside backend of examples/plugin_backend (written from docs/plugins.md), installed as a package
(`.ci/run` installs it): `loadopt bench` measures it, the attribution holds it to the ceiling it declares
and finds its injected delay, and `make_loader(backend="auto")` picks it when it won."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch
import yaml

from loadopt.loaders import registry

from .conftest import tiny_config_dict

try:
    version("loadopt-example-backend")
except PackageNotFoundError:
    pytest.skip("examples/plugin_backend is not installed (.ci/run installs it: pip install --no-deps "
                "--no-build-isolation -e examples/plugin_backend)", allow_module_level=True)

NAME = "example_jpeg"
DELAY_MS = 200.0  # per batch of 8 on top of the work: at most 40 samples/s
BATCH = 8
STEP_MS = 50.0  # the job asks 160 samples/s: more than the delayed backend gives, far less than decoding can


def bench(tmp_path, loaders: dict, name: str) -> tuple[dict, object]:
    from typer.testing import CliRunner

    from loadopt.cli import app

    out = tmp_path / name
    raw = tiny_config_dict(out, loaders=loaders, pipeline={"batch_size": BATCH, "image_size": 48},
                           workload={"step_time_ms": STEP_MS, "warmup_batches": 1, "measure_batches": 5,
                                     "repeats": 1})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["bench", str(path)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "results.json").read_text()), result


def test_the_installed_example_is_registered_by_its_entry_point():
    cls = registry.backend_class(NAME)
    assert NAME in registry.backend_names() and NAME not in registry.BUILTINS
    assert cls.__module__ == "loadopt_example_backend" and cls.available() == (True, "")
    assert cls.work_kind(cls.Settings(), None) == "jpeg_decode"


def test_bench_measures_it_and_the_attribution_finds_its_injected_delay(tmp_path, own_cache):
    # own_cache: the decision this bench records must not reach other tests' `auto`
    results, cli = bench(tmp_path, {NAME: {"threads": 2, "delay_ms": DELAY_MS}, "torch": {"variant": "tuned"}},
                         "delayed")
    run = next(r for r in results["runs"] if r["backend"] == NAME)
    assert run["label"] in cli.output  # its row in the table
    assert run["recipe"]["stored"] == "source"
    rate = run["metrics"]["samples_per_s"]
    rate = rate["median"] if isinstance(rate, dict) else rate
    assert rate <= 1.1 * BATCH / (DELAY_MS / 1000.0)  # the delay bounds it: at most 40 samples/s
    # Held to the decode ceiling it declares, never to the memory copy; far below it: the loader bounds the job.
    assert run["ceiling"]["name"].startswith("decode "), run["ceiling"]
    assert run["fraction_of_ceiling"] is not None and run["fraction_of_ceiling"] < 0.5
    verdict = next(v for v in results["verdicts"] if v["label"] == run["label"])
    assert verdict["bottleneck"] == "loader-bound", verdict["text"]
    assert "memory cop" not in verdict["text"]
    print(f"{run['label']}: {rate:.1f} samples/s, ceiling {run['ceiling']}, verdict: {verdict['text']}")
    # The delayed backend lost: `auto` builds the winner, torch.
    from loadopt import make_loader

    loader = make_loader(tmp_path / "delayed.yaml", backend="auto")
    try:
        assert loader.name == "torch"
    finally:
        loader.close()


def test_auto_picks_the_outside_backend_when_it_won(tmp_path, own_cache):
    results, _ = bench(tmp_path, {NAME: {"threads": 2}}, "alone")
    assert (tmp_path / "alone" / "decision.json").exists()
    assert json.loads((tmp_path / "alone" / "decision.json").read_text())["backend"] == NAME
    from loadopt import make_loader

    loader = make_loader(tmp_path / "alone.yaml", backend="auto")
    try:
        assert loader.name == NAME and type(loader).__module__ == "loadopt_example_backend"
        inputs, labels = next(iter(loader))
        assert inputs.shape == (BATCH, 3, 48, 48) and inputs.dtype == torch.float32 and len(labels) == BATCH
    finally:
        loader.close()
