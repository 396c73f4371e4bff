import json
import logging

import pytest
import torch
import yaml

from loadopt import make_loader
from loadopt.bench.runner import decision_path
from loadopt.errors import ConfigError
from loadopt.loaders.torch_dl.loader import TorchSettings
from loadopt.machine import machine_fingerprint, machine_info

from .conftest import tiny_config_dict


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(
        tmp_path / "r", loaders={"torch": {"num_workers": [1, 2]}},
        # a dataset of its own: the CLI tests record bench decisions for the shared tiny one
        dataset={"synthetic": {"num_samples": 48, "num_classes": 4, "mean_width": 96, "mean_height": 80, "seed": 7}})))
    return path


def test_drop_in_training_loop_with_resume(config_path):
    loader = make_loader(config_path, backend="torch", num_workers=1, batch_size=12)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(4))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    checkpoint = None
    for epoch in range(2):
        loader.set_epoch(epoch)
        for step, (images, labels) in enumerate(loader):
            assert images.shape[1:] == (3, 48, 48) and images.dtype == torch.float32
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            seen.append(labels.tolist())
            if epoch == 1 and step == 1:
                checkpoint = loader.state_dict()
    assert len(loader) == 4 and len(seen) == 8
    resumed = make_loader(config_path, backend="torch", num_workers=1, batch_size=12)
    resumed.load_state_dict(checkpoint)
    rest = [labels.tolist() for _, labels in resumed]
    assert rest == seen[6:]


def test_unknown_keyword_is_a_config_error(config_path):
    with pytest.raises(ConfigError, match="unknown keyword 'workers'"):
        make_loader(config_path, backend="torch", workers=3)


def test_auto_falls_back_and_says_why(config_path, caplog, monkeypatch):
    # The order without the backends that may or may not be installed here (dali, kvikio).
    monkeypatch.setattr("loadopt.api.FALLBACK_ORDER", ("arrow", "posix", "torch"))
    with caplog.at_level(logging.INFO, logger="loadopt"):
        loader = make_loader(config_path)
    # arrow comes first in the order, but its conversion does not exist and auto starts none
    # the sweep [1, 2] holds torch's default for this machine (a worker per core): that, not the first value
    assert loader.name == "torch" and loader.settings.num_workers == TorchSettings().num_workers == 2
    assert "num_workers=2 (swept [1, 2] in loaders.torch: the backend's default for this machine)" in caplog.text
    assert "skipping arrow" in caplog.text and "no bench decision" in caplog.text
    make_loader(config_path, backend="arrow").close()  # asked for by name: converts, as `loadopt convert` does
    assert make_loader(config_path).name == "arrow"


def write_decision(config_path, **changes):
    loader = make_loader(config_path, backend="torch")
    machine = machine_info()
    decision = {"backend": "torch", "settings": {"variant": "plain", "num_workers": 2}, "samples_per_s": 123.0,
                "machine_fingerprint": machine_fingerprint(machine),
                "pipeline": loader.pipeline.model_dump(mode="json"), **changes}
    path = decision_path(loader.dataset.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(decision))
    return path


def test_auto_uses_the_recorded_decision(config_path, caplog):
    path = write_decision(config_path)
    try:
        with caplog.at_level(logging.INFO, logger="loadopt"):
            loader = make_loader(config_path)
        assert loader.settings.variant == "plain" and loader.settings.num_workers == 2
        assert "fastest in the last bench" in caplog.text
        assert make_loader(config_path, num_workers=0).settings.num_workers == 0  # overrides win
    finally:
        path.unlink()


def test_auto_ignores_a_decision_from_another_machine(config_path, caplog):
    path = write_decision(config_path, machine_fingerprint="someone-else")
    try:
        with caplog.at_level(logging.INFO, logger="loadopt"):
            make_loader(config_path)
        assert "another machine" in caplog.text and "no bench decision" in caplog.text
    finally:
        path.unlink()


def test_bench_writes_decision_json_beside_the_results_and_keyed_in_the_cache(tmp_path, config_path, caplog):
    from loadopt.bench.decision import storage_tier
    from loadopt.bench.runner import run_bench
    from loadopt.config import load_config

    config = load_config(config_path, ["loaders.torch.num_workers=[0]", "loaders.arrow={form: decoded}"])
    outcome = run_bench(config, attribute=False)
    beside = json.loads((outcome.json_path.parent / "decision.json").read_text())
    assert beside == outcome.document()["decision"]
    assert beside["backend"] == outcome.document()["ranking"][0].split()[0]
    assert beside["runner_up"]["backend"] != beside["backend"] and beside["margin"] >= 1.0
    assert beside["date"] == beside["created"][:10] and beside["loadopt_version"]
    machine = beside["machine"]
    assert machine["cpu_model"] and machine["cpu_count"] >= 1 and "gpu" in machine
    assert machine["storage_tier"] == storage_tier("local", outcome.document()["dataset"]["root"])
    assert machine["storage_tier"].startswith("local:")
    assert beside["pipeline"] == config.pipeline.model_dump(mode="json") and beside["dataset_fingerprint"]
    # The cache keeps one entry per (pipeline, machine): a decision from elsewhere survives this bench.
    path = decision_path(beside["dataset_fingerprint"])
    other = {**beside, "backend": "torch", "machine_fingerprint": "elsewhere",
             "machine": {**machine, "cpu_count": 512, "fingerprint": "elsewhere"}}
    path.write_text(json.dumps({"entries": [other, beside]}))
    latest = run_bench(config, attribute=False).document()["decision"]
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2 and {e["machine_fingerprint"] for e in entries} == {"elsewhere",
                                                                                beside["machine_fingerprint"]}
    with caplog.at_level(logging.INFO, logger="loadopt"):
        loader = make_loader(config)
    assert loader.name == latest["backend"] and "fastest in the last bench on this machine" in caplog.text
    # Only the other machine's entry left: auto falls back and says what differs.
    path.write_text(json.dumps({"entries": [other]}))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loadopt"):
        make_loader(config)
    assert "another machine (cpu_count 512 there" in caplog.text
    path.unlink()


def test_auto_ignores_a_decision_for_another_storage_tier(config_path, caplog):
    loader = make_loader(config_path, backend="torch")
    path = write_decision(config_path, machine={"storage_tier": "local:nfs4", "cpu_count": 2})
    try:
        with caplog.at_level(logging.INFO, logger="loadopt"):
            make_loader(config_path).close()
        assert "fastest in the last bench" not in caplog.text and "first ready in the fallback order" in caplog.text
        assert "another machine" in caplog.text and "storage_tier 'local:nfs4' there" in caplog.text
    finally:
        path.unlink()
    loader.close()


def test_explain_says_which_decision_applies(config_path):
    from loadopt.config import load_config
    from loadopt.explain import explain_config

    config = load_config(config_path)
    path = write_decision(config_path, margin=1.5, runner_up={"label": "arrow decoded", "backend": "arrow"},
                          label="torch plain num_workers=2", loadopt_version="9.9", created="2030-01-02T00:00:00")
    try:
        text = explain_config(config)
        assert "auto uses: torch plain num_workers=2 (123 samples/s, 1.50x the runner-up arrow decoded)" in text
        assert "2030-01-02" in text and "loadopt 9.9" in text and "storage tier local:" in text
    finally:
        path.unlink()


def test_auto_finds_a_decision_recorded_under_an_inline_tier(config_path, caplog):
    from loadopt.bench.runner import run_bench
    from loadopt.config import load_config

    # An inline tier (a mapping, maybe with credentials) is keyed by its name in the decision.
    tier = "storage.tier={name: fastdisk, bandwidth_mb_s: 2000}"
    config = load_config(config_path, ["loaders.torch.num_workers=[0]", tier])
    decision = run_bench(config, attribute=False, quick=True).document()["decision"]
    assert decision["machine"]["storage_tier"].startswith("fastdisk:")
    try:
        with caplog.at_level(logging.INFO, logger="loadopt"):
            make_loader(config).close()
        assert "fastest in the last bench on this machine" in caplog.text
    finally:
        decision_path(decision["dataset_fingerprint"]).unlink()


def test_swept_knobs_take_the_backends_default_for_this_machine_and_say_so(tmp_path, caplog):
    """The shipped config's shape: lists sweep torch's variant and workers, dali's threads, arrow's form.
    Without a decision each swept knob takes the backend's default for this machine (the tuner's start)."""
    from loadopt.bench.knobs import search_space
    from loadopt.config import load_config
    from loadopt.loaders.posix.loader import PosixLoader, PosixSettings
    from loadopt.loaders.registry import backend_class
    from loadopt.machine import usable_cores

    cores = usable_cores()
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "r", loaders={
        "torch": {"variant": ["plain", "tuned"], "num_workers": [1, 2, 4], "prefetch_factor": 2},
        "dali": {"num_threads": [1, 2], "normalise": "device", "layout": "NHWC"},
        "arrow": {"form": ["decoded", "encoded"], "threads": 2},
        "posix": {"io_threads": [2, 8]}})))
    config = load_config(path)
    expect = {"torch": ("variant", "num_workers"), "arrow": ("form",), "posix": ("io_threads",),
              "dali": ("num_threads",)}
    for name, swept in expect.items():
        cls = backend_class(name)
        if not cls.available()[0]:
            continue
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="loadopt"):
            loader = make_loader(config, split="val", backend=name)
        defaults = cls.Settings()
        for key in swept:
            value = getattr(loader.settings, key)
            assert value == getattr(defaults, key)  # the backend's own default for this machine ...
            assert value == getattr(search_space(config, name, cls, cores)[1], key)  # ... the tuner's start too
            assert f"{key}={value!r} (swept " in caplog.text and "the backend's default" in caplog.text
        loader.close()
    # Machine-sized defaults: a torch worker per core (up to 8), posix reads in flight per core (2 to 8).
    assert backend_class("torch").Settings().num_workers == min(8, cores)
    assert PosixSettings().io_threads == min(8, max(2, cores)) and PosixSettings().io_threads in \
        PosixLoader.knob_space(cores)["io_threads"]
    # A sweep without the default starts at its first value and says why; a keyword wins and says so.
    workers = [min(8, cores) + 1, min(8, cores) + 2]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loadopt"):
        loader = make_loader(load_config(path, [f"loaders.torch.num_workers={workers}"]), split="val",
                             backend="torch", num_workers=0, variant="plain", batch_size=12)
    assert (loader.settings.variant, loader.settings.num_workers) == ("plain", 0)
    assert "torch knobs: passed to make_loader: variant='plain', num_workers=0; prefetch_factor=2 (set in " \
           "loaders.torch); at the backend's defaults: " in caplog.text
    loader.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loadopt"):
        loader = make_loader(load_config(path, [f"loaders.torch.num_workers={workers}"]), split="val", backend="torch")
    assert loader.settings.num_workers == workers[0]
    assert f"num_workers={workers[0]} (swept {workers} in loaders.torch: its first value (the backend's default " \
           f"for this machine, {min(8, cores)}, is not among them)" in caplog.text
    loader.close()


def test_make_loader_says_once_on_stderr_which_backend_it_took_unless_quiet(tmp_path, capfd, monkeypatch):
    config = tiny_config_dict(tmp_path / "out")
    monkeypatch.delenv("LOADOPT_QUIET", raising=False)
    make_loader(config, backend="torch", num_workers=0).close()
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("loadopt: make_loader took")]
    assert said == [said[0]] and said[0].startswith("loadopt: make_loader took torch (") and \
        said[0].endswith(": asked for by name")
    monkeypatch.setenv("LOADOPT_QUIET", "1")
    make_loader(config, backend="torch", num_workers=0).close()
    assert "make_loader took" not in capfd.readouterr().err
